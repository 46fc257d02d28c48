"""Export a checkpoint as a Hugging Face transformers folder: see cramming/hf/export.py.

python scripts/export_hf.py <run folder | checkpoint folder | run name> <out folder> [--base-dir outputs] [--glue <eval folder>]
"""

from cramming.hf.export import main

if __name__ == "__main__":
    main()
