"""Export a checkpoint as a Hugging Face transformers folder: see cramming/hf/export.py.

python scripts/export_hf.py <run folder | checkpoint folder | run name> <out folder> [--base-dir outputs] [--glue <eval folder>]
"""

import sys

from cramming.job import exits

try:
    from cramming.hf.export import main
except ModuleNotFoundError as err:  # transformers is not installed: one line and the install, not a traceback
    if err.name != "transformers":
        raise
    print(f"export failed: {err}", file=sys.stderr)
    sys.exit(exits.USER_ERROR)

if __name__ == "__main__":
    main()
