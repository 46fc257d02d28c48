"""A battery of bad inputs, as a hostile but ordinary user would give them: bad configs, bad data files, damaged
checkpoints and states, bad GLUE folders, exports to the wrong place, signals at awkward moments, a full disk,
and valid controls beside them.

The rule each case checks (docs/exit-codes.md): a job that cannot do what it was asked exits non-zero with one
message naming the input, the problem and the fix, never a traceback, and never reports success it did not
have. Each case asserts the exit status, the absence of a traceback and the words that name the problem.

To stay fast, the cases share one tiny pretraining run (the embedded corpus, 3 updates), and the commands that
need no process of their own run in one (tests/command_runner.py); signals and the full disk get real processes
(a stop signal at each phase of preprocessing: one process per case, forked by tests/stop_runner.py).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import data_dir
from stop_runner import PHASES as STOP_PHASES

from cramming.data.sources import FILE_HASHES
from cramming.errors import RunStopped, stop_in_chain
from cramming.job import exits
from cramming.signals import STOP_SIGNALS

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = str(REPO / "pretrain.py")
EVAL = str(REPO / "eval.py")
EXPORT = str(REPO / "scripts" / "export_hf.py")
# a tiny run on the embedded corpus: every pretraining case starts from these and changes one thing
TINY = (
    "arch=tiny",
    "data=embedded",
    "data.tokenizer.vocab_size=1024",
    "base_dir={base}",
    "impl.device=cpu",
    "impl.cpu_threads=1",
    "impl.num_proc=1",
    "impl.num_workers=0",
    "impl.microbatch_size=8",
    "train.batch_size=8",
    "train.batch_size_ramp=0",
    "train.steps=3",
    "train.validation_rows=16",
    "budget=0.5",
)
LOCAL = ("data=local", "data.tokenizer.vocab_size=1024", "data.sources.local.files={bad}/{case}")
# evaluation of the shared run: small, so that the valid control finishes in seconds
SMALL_EVAL = (
    "checkpoint={run}",
    "base_dir={base}",
    "impl.device=cpu",
    "impl.cpu_threads=1",
    "eval.tasks=[RTE]",
    "eval.glue_dir={glue}",
    "eval.max_train_examples=16",
    "eval.max_eval_examples=16",
    "eval.epochs=1",
    "eval.batch_size=8",
)

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Case:
    """One command line and how it must end: `code`, and `words` in its output (case-insensitive)."""

    id: str
    argv: tuple[str, ...]
    code: int
    words: tuple[str, ...] = ()


def pretrain(id: str, *args: str, code: int = 2, words: tuple[str, ...] = (), base=TINY) -> Case:
    return Case(id, (PRETRAIN, *base, *args), code, words)


def evaluate(id: str, *args: str, code: int = 2, words: tuple[str, ...] = ()) -> Case:
    return Case(id, (EVAL, *SMALL_EVAL, *args), code, words)


def local_data(id: str, *args: str, words: tuple[str, ...]) -> Case:
    """Pretraining on the bad files written for this case into {bad}/<id> (BAD_FILES)."""
    return Case(id, (PRETRAIN, *TINY, *LOCAL, *args), 2, words)


CASES = [
    # ---- configuration: every number finite and in range, every key known, keys consistent
    pretrain("budget-nan", "budget=nan", words=("budget=nan", "finite")),
    pretrain("budget-inf", "budget=inf", words=("budget=inf", "finite")),
    pretrain("budget-negative", "budget=-1", words=("budget", "hours")),
    pretrain("budget-zero", "budget=0", words=("budget", "hours")),
    pretrain("budget-text", "budget=abc", words=("budget",)),
    pretrain("lr-nan", "train.optim.lr=nan", words=("train.optim.lr=nan", "finite")),
    pretrain("lr-inf", "train.optim.lr=inf", words=("train.optim.lr=inf",)),
    pretrain("batch-not-divided", "train.batch_size=12", words=("train.batch_size", "divisible by 8")),
    pretrain("batch-below-micro", "train.batch_size=4", words=("train.batch_size", "impl.microbatch_size=4")),
    pretrain("unknown-top-key", "+foo=1", words=("unknown", "foo")),
    pretrain("unknown-nested-key", "+train.foo=1", words=("unknown", "train.foo")),
    pretrain("misspelled-key", "train.batchsize=8", words=("batchsize", "did you mean", "train.batch_size")),
    pretrain(
        "key-one-letter-off", "arch.num_head=3", words=("arch.num_head", "did you mean", "arch.num_heads")
    ),
    pretrain("key-transformers-name", "arch.num_attention_heads=3", words=("did you mean", "arch.num_heads")),
    pretrain(
        "optim-shorthand-unknown",
        "train.optim=adam9",
        words=("train.optim=adam9", "no optimizer", "adamw_8bit", "train/optim=adamw_8bit"),
    ),
    pretrain("unknown-arch", "arch=nosuch", words=("arch", "nosuch")),
    pretrain("unknown-optimizer", "train.optim.name=nosuch", words=("train.optim.name", "choose one of")),
    pretrain("unknown-schedule", "train.lr_schedule=nosuch", words=("train.lr_schedule", "choose one of")),
    pretrain("mask-fraction", "train.mlm.mask_fraction=1.5", words=("train.mlm.mask_fraction",)),
    pretrain("zero-steps", "train.steps=0", words=("train.steps",)),
    pretrain("zero-microbatch", "impl.microbatch_size=0", words=("impl.microbatch_size",)),
    pretrain("name-with-slash", "name=a/b", words=("name",)),
    pretrain("rows-longer-than-model", "data.seq_length=100000", words=("data.seq_length",)),
    pretrain("unknown-precision", "impl.precision=fp8", words=("impl.precision", "choose one of")),
    *(  # a GPU asked for on a machine without one (on a GPU machine, one it lacks)
        [pretrain("cuda-without-gpu", "impl.device=cuda", words=("impl.device", "impl.device=cpu"))]
        if not torch.cuda.is_available()
        else [pretrain("cuda-index-absent", "impl.device=cuda:99", words=("impl.device", "impl.device=cpu"))]
    ),
    # ---- runs that would have reported success with nothing done
    pretrain(
        "budget-before-first-update", "budget=1e-9", "train.steps=null", words=("first update", "budget")
    ),
    pretrain("resume-nothing", "name=never-ran", "resume=true", words=("resume=true", "never-ran")),
    pretrain("resume-finished", "name=baseline", "resume=true", words=("already finished", "train.steps")),
    pretrain(
        "resume-other-arch",
        "name=baseline",
        "resume=true",
        "train.steps=10",
        "arch.num_layers=3",
        words=("arch.num_layers", "2 there, 3 here"),
    ),
    pretrain(
        "resume-damaged-state", "name=broken", "resume=true", "train.steps=10", words=("does not load",)
    ),
    # ---- data files
    local_data("data-not-gzip", words=("not gzip", "data-not-gzip")),
    local_data("data-truncated-gzip", words=("cut short", "data-truncated-gzip")),
    local_data("data-numbers-as-text", words=("holds int64", "text_field")),
    local_data("data-other-field", words=("no field 'text'", "text_field")),
    local_data("data-not-utf8", words=("not utf-8", "data-not-utf8")),
    local_data("data-all-empty", words=("empty",)),
    local_data("data-no-files", words=("no readable text files", "get_data.py wikipedia")),
    # ---- evaluation
    evaluate("eval-zero-examples", "eval.max_train_examples=0", words=("eval.max_train_examples",)),
    evaluate("eval-task-twice", "eval.tasks=[RTE,RTE]", words=("eval.tasks", "more than once", "eval.seeds")),
    evaluate("eval-no-tasks", "eval.tasks=[]", words=("eval.tasks", "at least one task")),
    evaluate("eval-unknown-task", "eval.tasks=[NOPE]", words=("eval.tasks", "choose one of")),
    evaluate("eval-seed-twice", "eval.seeds=[0,0]", words=("eval.seeds", "more than once")),
    evaluate("eval-no-seeds", "eval.seeds=[]", words=("eval.seeds",)),
    evaluate("eval-lr-nan", "eval.optim.lr=nan", words=("eval.optim.lr=nan", "finite")),
    evaluate("eval-budget-nan", "budget=nan", words=("budget=nan", "finite")),
    evaluate("eval-unknown-key", "+eval.foo=1", words=("unknown", "eval.foo")),
    evaluate("eval-no-checkpoint", "checkpoint={bad}/nowhere", words=("no checkpoint",)),
    evaluate(
        "eval-damaged-checkpoint",
        "checkpoint={bad}/damaged-run",
        words=("model.safetensors", "does not load"),
    ),
    evaluate(
        "eval-glue-dir-missing", "eval.glue_dir={bad}/no-glue", words=("eval.glue_dir", "no such folder")
    ),
    evaluate(
        "eval-glue-header-only", "eval.glue_dir={bad}/glue-header-only", words=("train.tsv", "no examples")
    ),
    evaluate(
        "eval-hf-config-not-json", "checkpoint=hf:{bad}/hf-bad-config", words=("config.json", "does not load")
    ),
    # ---- export
    Case("export-damaged", (EXPORT, "{bad}/damaged-run", "{bad}/export-damaged"), 2, ("does not load",)),
    Case("export-into-file", (EXPORT, "{run}", "{bad}/a-file"), 2, ("is a file",)),
    Case("export-nothing", (EXPORT, "{bad}/nowhere", "{bad}/export-nothing"), 2, ("no checkpoint",)),
    Case("export-not-empty", (EXPORT, "{run}", "{bad}/not-empty"), 2, ("not empty",)),
    # ---- valid controls: the same commands with good inputs still run
    evaluate("control-eval", code=0, words=("glue results",)),
    Case("control-export", (EXPORT, "{run}", "{bad}/exported"), 0, ("wrote",)),
    pretrain(
        "control-resume", "name=baseline", "resume=true", "train.steps=4", code=0, words=("resuming from",)
    ),
    # the transformers spelling of an optimizer, read as the config group (its settings file)
    pretrain(
        "control-optim-shorthand",
        "train.optim=adamw_8bit",
        code=0,
        words=("train.optim=adamw_8bit is read as train/optim=adamw_8bit", "optimizer adamw_8bit"),
    ),
    evaluate(
        "control-eval-optim-shorthand",
        "eval.optim=adamw_8bit",
        code=0,
        words=("eval.optim=adamw_8bit is read as eval.optim.name=adamw_8bit", "glue results"),
    ),
]


def write_bad_inputs(bad: Path, run: Path, real_glue: Path) -> None:
    """The damaged files and folders the cases name, under `bad`; `run` is the shared run's folder."""
    from cramming.hf.export import to_transformers  # transformers: imported by the tests that need it only

    shard = bad / "data-not-gzip"
    shard.mkdir(parents=True)
    (shard / "a.jsonl.gz").write_text('{"text": "plain text under a gzip name"}\n')
    whole = gzip.compress(("\n".join(json.dumps({"text": "word " * 40}) for _ in range(400)) + "\n").encode())
    (bad / "data-truncated-gzip").mkdir()
    (bad / "data-truncated-gzip" / "a.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (bad / "data-numbers-as-text").mkdir()
    (bad / "data-numbers-as-text" / "a.jsonl").write_text("".join(f'{{"text": {i}}}\n' for i in range(50)))
    (bad / "data-other-field").mkdir()
    (bad / "data-other-field" / "a.jsonl").write_text("".join(f'{{"body": "row {i}"}}\n' for i in range(50)))
    (bad / "data-not-utf8").mkdir()
    (bad / "data-not-utf8" / "a.txt").write_bytes(b"some text\n" * 20 + b"\xff\xfe\x00 binary \x80\x81\n")
    (bad / "data-all-empty").mkdir()
    (bad / "data-all-empty" / "a.txt").write_bytes(b"")
    (bad / "data-no-files").mkdir()
    (bad / "data-no-files" / "notes.csv").write_text("a,b\n")
    damaged = bad / "damaged-run"
    shutil.copytree(run, damaged)
    weights = damaged / "checkpoint" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    glue = bad / "glue-header-only" / "RTE"
    glue.mkdir(parents=True)
    shutil.copy(real_glue / "RTE" / "dev.tsv", glue / "dev.tsv")
    (glue / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n")
    exported = to_transformers(run, bad / "hf-bad-config")
    (exported / "config.json").write_text('{"model_type": "crammed_bert", "hidden_size": ')  # cut short
    (bad / "a-file").write_text("not a folder\n")
    (bad / "not-empty").mkdir()
    (bad / "not-empty" / "keep.txt").write_text("someone's file\n")


def break_state(base: Path, run: Path) -> None:
    """A copy of the shared run under the name `broken` whose resumable states do not load."""
    copy = base / "broken" / run.name
    shutil.copytree(run, copy)
    (copy / "state.pt").write_bytes((copy / "state.pt").read_bytes()[:2000])
    (copy / "state.prev.pt").unlink(missing_ok=True)


def environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    """The shared tiny run (name=baseline), its damaged copies and the bad files: {base}, {run}, {bad}, {glue}."""
    glue = data_dir("glue", "RTE", "train.tsv").parent.parent
    base, bad = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("bad")
    command = [sys.executable, PRETRAIN, *(a.format(base=base) for a in TINY), "name=baseline"]
    done = subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = next((base / "baseline").iterdir())
    write_bad_inputs(bad, run, glue)
    break_state(base, run)
    return {"base": str(base), "run": str(run), "bad": str(bad), "glue": str(glue)}


def run_cases(cases: list[Case], places: dict, folder: Path, env: dict | None = None, preexec=None) -> dict:
    """Every case of `cases`, run in one process (tests/command_runner.py): {id: {code, output, seconds}}."""
    commands = [
        {"id": case.id, "argv": [arg.format(case=case.id, **places) for arg in case.argv]} for case in cases
    ]
    (folder / "commands.json").write_text(json.dumps(commands))
    runner = [sys.executable, str(REPO / "tests" / "command_runner.py"), *(str(folder / n) for n in ("commands.json", "results.json"))]  # fmt: skip
    done = subprocess.run(
        runner,
        cwd=REPO,
        env=env or environment(),
        capture_output=True,
        text=True,
        timeout=1200,
        preexec_fn=preexec,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((folder / "results.json").read_text())


@pytest.fixture(scope="module")
def outcomes(places, tmp_path_factory) -> dict[str, dict]:
    return run_cases(CASES, places, tmp_path_factory.mktemp("runner"))


def check_outcome(outcome: dict, code: int, words: tuple[str, ...]) -> None:
    output = outcome["output"]
    assert "Traceback" not in output, f"a traceback instead of a message:\n{output[-4000:]}"
    assert outcome["code"] == code, f"exit {outcome['code']}, expected {code}:\n{output[-3000:]}"
    missing = [word for word in words if word.lower() not in output.lower()]
    assert not missing, f"the output does not name {missing}:\n{output[-3000:]}"


def test_the_battery_is_large_enough():
    assert len(CASES) >= 40 and len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input(case: Case, outcomes):
    check_outcome(outcomes[case.id], case.code, case.words)


# ------------------------------------------------------------------------ files this user may not read

# Each names a file or folder the user may not read (mode 000), where a user names a path: it ends with exit 2
# and one line naming the file and the permission, never a PermissionError's traceback. The runner meets the
# permissions as a user other than root would (run as root, it runs without root's permission override).
PERMISSION_CASES = [
    Case("perm-corpus-file", (PRETRAIN, *TINY, *LOCAL[:2], "data.sources.local.files={perm}/corpus"), 2,
         ("b.jsonl", "permission denied", "---------", "data.sources.<name>.files")),
    Case("perm-corpus-folder", (PRETRAIN, *TINY, *LOCAL[:2], "data.sources.local.files={perm}/closed/*.jsonl"),
         2, ("closed", "permission denied", "chmod a+rx")),
    Case("perm-glue-file", (EVAL, *SMALL_EVAL, "eval.glue_dir={perm}/glue"), 2,
         ("train.tsv", "permission denied", "eval.glue_dir")),
    Case("perm-checkpoint-file", (EVAL, *SMALL_EVAL, "checkpoint={perm}/run"), 2,
         ("model.safetensors", "permission denied", "checkpoint")),
    Case("perm-checkpoint-folder", (EVAL, *SMALL_EVAL, "checkpoint={perm}/closed-run"), 2,
         ("closed-run", "permission denied")),
    Case("perm-hf-file", (EVAL, *SMALL_EVAL, "checkpoint=hf:{perm}/hf"), 2,
         ("config.json", "permission denied", "checkpoint=hf:")),
    Case("perm-blimp-file", (EVAL, *SMALL_EVAL, "eval=blimp", "blimp.dir={perm}/blimp"), 2,
         ("adjunct_island.jsonl", "permission denied", "blimp.dir")),
    Case("perm-export", (EXPORT, "{perm}/run", "{perm}/exported"), 2, ("model.safetensors", "permission denied")),
]  # fmt: skip


def without_root_override():
    """A preexec_fn that drops root's permission to read and enter anything (CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH, from the bounding set: gone after exec), so that a file of mode 000 is as unreadable
    to the test as to any other user; None when the tests run as another user already."""
    if os.geteuid() != 0:
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop, dac_override, dac_read_search = 24, 1, 2

    def drop() -> None:
        for capability in (dac_override, dac_read_search):
            if libc.prctl(pr_capbset_drop, capability, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    probe = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=drop, capture_output=True)
    if probe.returncode != 0:
        pytest.skip(
            "root here cannot give up its permission override (no CAP_SETPCAP): mode 000 stays readable"
        )
    return drop


def write_unreadable(perm: Path, run: Path, real_glue: Path) -> list[Path]:
    """The files and folders PERMISSION_CASES name under `perm`, each readable but for one part (mode 000).
    Returns the parts made unreadable."""
    from cramming.hf.export import to_transformers

    (perm / "corpus").mkdir(parents=True)
    for name in ("a.jsonl", "b.jsonl"):
        (perm / "corpus" / name).write_text(
            "".join(json.dumps({"text": f"row {i} " * 20}) + "\n" for i in range(40))
        )
    (perm / "closed").mkdir()
    (perm / "closed" / "a.jsonl").write_text(json.dumps({"text": "words " * 20}) + "\n")
    shutil.copytree(real_glue / "RTE", perm / "glue" / "RTE")
    shutil.copytree(run, perm / "run")
    shutil.copytree(run, perm / "closed-run")
    to_transformers(run, perm / "hf")
    (perm / "blimp").mkdir()
    pair = {"sentence_good": "A cat sleeps.", "sentence_bad": "A cat sleep.", "field": "morphology",
            "linguistics_term": "s-v agreement", "UID": "adjunct_island", "pairID": "0"}  # fmt: skip
    (perm / "blimp" / "adjunct_island.jsonl").write_text(json.dumps(pair) + "\n")
    closed = [perm / "corpus" / "b.jsonl", perm / "closed", perm / "glue" / "RTE" / "train.tsv",
              perm / "run" / "checkpoint" / "model.safetensors", perm / "closed-run", perm / "hf" / "config.json",
              perm / "blimp" / "adjunct_island.jsonl"]  # fmt: skip
    for path in closed:
        path.chmod(0)
    return closed


@pytest.fixture(scope="module")
def permission_outcomes(places, tmp_path_factory) -> dict[str, dict]:
    preexec = without_root_override()
    perm = tmp_path_factory.mktemp("perm")
    closed = write_unreadable(perm, Path(places["run"]), Path(places["glue"]))
    try:
        return run_cases(
            PERMISSION_CASES, places | {"perm": str(perm)}, tmp_path_factory.mktemp("r"), None, preexec
        )
    finally:
        for path in closed:
            path.chmod(0o755 if path.is_dir() else 0o644)


@pytest.mark.parametrize("case", PERMISSION_CASES, ids=[case.id for case in PERMISSION_CASES])
def test_a_path_the_user_may_not_read(case: Case, permission_outcomes):
    outcome = permission_outcomes[case.id]
    check_outcome(outcome, case.code, case.words)
    assert "PermissionError" not in outcome["output"]


# ------------------------------------------------------------------------ out of memory, no transformers

# pretrain.py whose model runs out of memory in its first forward pass, as a GPU's would: the error PyTorch
# raises then, simulated (restored afterwards: the runner runs other commands in the same process)
OUT_OF_MEMORY = """
import runpy, sys, torch
from cramming.model.bert import BertForMLM

def forward(self, *args, **kwargs):
    raise torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which"
        " 1.06 GiB is free.\\nIf reserved but unallocated memory is large try setting expandable_segments"
    )

original, BertForMLM.forward = BertForMLM.forward, forward
try:
    sys.argv[0] = {pretrain!r}
    runpy.run_path({pretrain!r}, run_name="__main__")
finally:
    BertForMLM.forward = original
"""


def test_out_of_memory_exits_2_with_the_micro_batch_advice(places, tmp_path):
    script = tmp_path / "oom_pretrain.py"
    script.write_text(OUT_OF_MEMORY.format(pretrain=PRETRAIN))
    case = Case("oom", (str(script), *TINY, "name=oom"), 2, ("out of memory", "impl.microbatch_size=auto"))
    outcome = run_cases([case], places, tmp_path)["oom"]
    check_outcome(outcome, case.code, case.words)
    errors = [line for line in outcome["output"].splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "expandable_segments" not in errors[0], outcome["output"][-2000:]
    card = json.loads(next((Path(places["base"]) / "oom").glob("*/run_card.json")).read_text())
    assert card["status"] == "failed" and "impl.microbatch_size=auto" in card["error"]


def test_hf_folders_without_transformers_exit_2_naming_the_install(places, tmp_path):
    """transformers absent (a package of that name that cannot be imported shadows it): evaluating or exporting a
    transformers folder ends in one line that says what to install."""
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'transformers'\", name='transformers')\n"
    )
    from cramming.hf.export import to_transformers

    exported = to_transformers(Path(places["run"]), tmp_path / "hf")
    words = ("transformers is not installed", "pip install -e '.[hf]'")
    cases = [
        Case("eval-hf", (EVAL, *SMALL_EVAL, f"checkpoint=hf:{exported}"), 2, words),
        Case("blimp-hf", (EVAL, *SMALL_EVAL, "eval=blimp", f"checkpoint=hf:{exported}"), 2, words),
        Case("export", (EXPORT, "{run}", str(tmp_path / "out")), 2, words),
    ]
    env = environment() | {"PYTHONPATH": str(tmp_path / "site")}
    outcomes = run_cases(cases, places, tmp_path, env)
    for case in cases:
        check_outcome(outcomes[case.id], case.code, case.words)


# ------------------------------------------------------------------------ in processes of their own


def start_pretraining(places: dict, base: Path, *args: str) -> subprocess.Popen:
    argv = [sys.executable, PRETRAIN, *(a.format(**places) for a in TINY), f"base_dir={base}", *args]
    return subprocess.Popen(
        argv, cwd=REPO, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


# A stop signal at each phase of preprocessing, landing inside the code that does the phase's work
# (tests/stop_runner.py patches that code to send the signal itself, so no case depends on timing): the run
# ends as a stop, 128 + the signal, with an interrupted card and nothing half-built. The `wrapped` cases add a
# library that turns whatever passes through it into its own error: the stop is still found behind it (by the
# source reader, and by run_job).
STOP_CASES = [(f"{phase}-{name}", phase, name, False) for phase in STOP_PHASES for name in STOP_SIGNALS] + [
    ("read-SIGTERM-wrapped", "read", "SIGTERM", True),
    ("save-SIGTERM-wrapped", "save", "SIGTERM", True),
]


def write_stop_corpus(path: Path) -> None:
    """Enough text for a few rows of every split, made up: the tests need no downloaded data."""
    words = ["river", "hill", "town", "bridge", "market", "winter", "harvest", "road", "forest", "village"]
    with open(path, "w", encoding="utf-8") as f:
        for doc in range(200):
            text = " ".join(words[(doc * 7 + i * i) % len(words)] for i in range(80))
            f.write(json.dumps({"text": f"Document {doc}. {text}."}) + "\n")


@pytest.fixture(scope="module")
def stops(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """Every case of STOP_CASES, each in a process of its own forked from one that imported everything once."""
    folder = tmp_path_factory.mktemp("stops")
    write_stop_corpus(folder / "corpus.jsonl")
    cases = []
    for id, phase, name, wrap in STOP_CASES:
        (folder / id / "tmp").mkdir(parents=True)
        args = [a.format(base=folder / id / "base") for a in TINY if a != "data=embedded"]
        argv = [PRETRAIN, *args, "data=local", f"data.sources.local.files={folder / 'corpus.jsonl'}", "dryrun=true"]  # fmt: skip
        cases.append({"id": id, "phase": phase, "signal": name, "wrap": wrap, "argv": argv, "tmpdir": str(folder / id / "tmp")})  # fmt: skip
    (folder / "cases.json").write_text(json.dumps(cases))
    runner = [sys.executable, str(REPO / "tests" / "stop_runner.py"), str(folder / "cases.json"), str(folder / "results.json")]  # fmt: skip
    done = subprocess.run(runner, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folder, json.loads((folder / "results.json").read_text())


@pytest.mark.parametrize(("id", "phase", "name", "wrap"), STOP_CASES, ids=[case[0] for case in STOP_CASES])
def test_a_stop_signal_at_each_phase_of_preprocessing_stops_the_run_and_keeps_nothing_half_built(
    id, phase, name, wrap, stops
):
    folder, results = stops
    check_outcome(
        results[id],
        128 + signal.Signals[name],
        (f"sending {name} while {STOP_PHASES[phase]}", f"{name} received", "preprocessing stopped"),
    )
    base = folder / id / "base"
    card = json.loads(next((base / "default").glob("*/run_card.json")).read_text())
    assert card["status"] == "interrupted" and name in card["error"]
    # no processed-data folder, finished or half-built; in the `datasets` cache, no unfinished folder or file
    assert sorted(p.name for p in (base / "data").iterdir()) <= ["hf", FILE_HASHES]
    unfinished = [
        p for p in (base / "data").rglob("*") if p.name.endswith(".incomplete") or p.name.startswith("tmp")
    ]
    assert unfinished == [], "unfinished files of `datasets` were left behind"
    assert list((folder / id / "tmp").iterdir()) == [], "temporary files were left behind"


def test_a_stop_wrapped_in_other_errors_is_found_and_ends_as_a_stop():
    stop = RunStopped("SIGUSR2", "preprocessing stopped; nothing of it is kept", resumable=False)
    assert isinstance(stop, KeyboardInterrupt) and not isinstance(stop, Exception)
    assert stop_in_chain(stop) is stop and exits.exit_code(stop) == 128 + signal.SIGUSR2
    wrapped = RuntimeError("An error occurred while generating the dataset")  # raise ... from the stop
    wrapped.__cause__ = stop
    handled = ValueError("could not read 1 json file(s)")  # raised while handling it: only the context
    handled.__context__ = wrapped
    assert stop_in_chain(handled) is stop and exits.exit_code(handled) == 128 + signal.SIGUSR2

    class Group(Exception):  # the shape of an exception group (ExceptionGroup, Python 3.11)
        def __init__(self, exceptions):
            super().__init__("workers failed")
            self.exceptions = tuple(exceptions)

    assert stop_in_chain(Group([ValueError("one"), wrapped])) is stop
    assert stop_in_chain(Group([ValueError("one")])) is None and exits.exit_code(ValueError("bad")) is None
    cycle = OSError("one")
    cycle.__context__ = OSError("two")
    cycle.__context__.__context__ = cycle
    assert stop_in_chain(cycle) is None


def test_a_worker_forked_during_preprocessing_ends_by_the_signal_and_leaves_the_stop_to_its_parent():
    with exits.stop_at_once("preprocessing"):
        pid = os.fork()
        if pid == 0:  # a pool's worker: SIGTERM is what its pool's terminate() sends
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
            finally:
                os._exit(0)  # not reached: the signal ends the process
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


def test_a_build_folder_of_a_dead_process_is_removed_and_a_live_one_kept(tmp_path):
    from cramming.data.pipeline import remove_abandoned_builds

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    path = tmp_path / "cache-key"
    abandoned = tmp_path / f".cache-key.building-{int(dead.stdout)}"
    running = tmp_path / f".cache-key.building-{os.getpid()}"
    for folder in (abandoned, running):
        (folder / "scratch").mkdir(parents=True)
    assert remove_abandoned_builds(path) == [abandoned]
    assert not abandoned.exists() and running.exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MiB file system: room for the tiny run's data, not for its resumable state beside the margin."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small file system here ({done.stderr.decode().strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_a_clear_error_with_the_space_needed(places, small_disk):
    process = start_pretraining(places, small_disk)
    output, _ = process.communicate(timeout=300)
    check_outcome({"code": process.returncode, "output": output}, 4, ("disk space", "MiB", "base_dir"))
