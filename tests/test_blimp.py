"""BLiMP scoring: pseudo-log-likelihoods equal an independent computation in plain transformers, hand-made
pairs whose answer is known, ties fail, and a stopped evaluation resumes per paradigm."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from cramming.eval import blimp
from cramming.eval.blimp import BlimpConfig, CrammedMaskedLM, MaskedLM

REPO = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------ a known masked LM


def word_tokenizer() -> Tokenizer:
    """WordPiece over a handful of words, so that `running` is `run ##ning` (a word in two pieces)."""
    vocab = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        "the",
        "cat",
        "cats",
        "dog",
        "run",
        "##ning",
        "is",
        "are",
        ".",
    ]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return tok


class UnigramLM(MaskedLM):
    """log P(token) from a fixed table whatever the context: a sentence's PLL is the sum of its tokens'."""

    def __init__(self, table: dict[int, float]):
        super().__init__(word_tokenizer(), mask_id=4, device=torch.device("cpu"))
        self.table = table
        self.seen: list[list[int]] = []

    def log_probs(self, input_ids, positions, targets):
        self.seen += input_ids.tolist()
        return torch.tensor([self.table.get(t, -10.0) for t in targets.tolist()])


def test_pll_sums_each_tokens_log_probability_and_a_tie_fails():
    tok = word_tokenizer()
    ids = {w: tok.token_to_id(w) for w in ("the", "cat", "cats", "is", "are", ".")}
    lm = UnigramLM(
        {
            ids["the"]: -1.0,
            ids["cat"]: -2.0,
            ids["cats"]: -3.0,
            ids["is"]: -1.5,
            ids["are"]: -4.0,
            ids["."]: -0.5,
        }
    )
    good, bad, same = blimp.pseudo_log_likelihoods(
        lm, ["the cat is .", "the cat are .", "the cat is ."], "pll", 3
    )
    assert good == pytest.approx(-1.0 - 2.0 - 1.5 - 0.5) and bad == pytest.approx(-1.0 - 2.0 - 4.0 - 0.5)
    assert blimp.passed({"pll_good": good, "pll_bad": bad})
    assert not blimp.passed({"pll_good": good, "pll_bad": same})  # a tie fails
    assert not blimp.passed({"pll_good": bad, "pll_bad": good})


def test_within_word_l2r_masks_the_later_pieces_of_the_word():
    tok = word_tokenizer()
    ids, words = blimp.token_ids(tok, "the dog running")
    assert tok.decode(ids, skip_special_tokens=False).split() == [
        "[CLS]",
        "the",
        "dog",
        "run",
        "##ning",
        "[SEP]",
    ]
    plain = blimp.masked_rows(ids, words, mask_id=4, variant="pll")
    l2r = blimp.masked_rows(ids, words, mask_id=4, variant="within_word_l2r")
    assert [row[1] for row in plain] == [row[1] for row in l2r] == [1, 2, 3, 4]  # one copy per real token
    run_copy = dict((pos, masked) for masked, pos, _ in l2r)[3]
    assert run_copy[3] == run_copy[4] == 4  # `run` scored with `##ning` masked too
    assert dict((pos, masked) for masked, pos, _ in plain)[3][4] == ids[4]  # plain PLL leaves it
    assert dict((pos, masked) for masked, pos, _ in l2r)[4][3] == ids[3]  # the last piece sees the first


def test_sentences_of_one_length_share_batches_without_padding():
    lm = UnigramLM({})
    blimp.pseudo_log_likelihoods(lm, ["the cat is .", "the dog is .", "the cat ."], "pll", batch_rows=100)
    assert {len(row) for row in lm.seen} == {5, 6}  # each batch one length: no row is padded
    assert len(lm.seen) == 4 + 4 + 3


# ------------------------------------------------------------------------------- files, results, resume


def write_paradigm(folder: Path, uid: str, term: str, field: str, n: int, gz: bool = True) -> None:
    rows = [
        {"sentence_good": "the cat is .", "sentence_bad": "the cat are .", "UID": uid, "pairID": str(i),
         "linguistics_term": term, "field": field}
        for i in reversed(range(n))  # out of order: the reader sorts by pairID
    ]  # fmt: skip
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        (folder / f"{uid}.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    else:
        (folder / f"{uid}.jsonl").write_text(text)


def test_results_per_paradigm_phenomenon_and_field_and_a_resume_scores_only_what_is_left(tmp_path):
    data = tmp_path / "blimp"
    data.mkdir()
    write_paradigm(data, "agreement_a", "subject_verb_agreement", "morphology", 5)
    write_paradigm(data, "agreement_b", "subject_verb_agreement", "morphology", 5, gz=False)
    write_paradigm(data, "island", "island_effects", "syntax", 5)
    tok = word_tokenizer()
    lm = UnigramLM({tok.token_to_id("is"): -1.0, tok.token_to_id("are"): -2.0})
    cfg = BlimpConfig(dir=str(data), pairs_per_paradigm=3, variant="pll")
    asked = []
    partial = blimp.run_blimp(lm, cfg, tmp_path, stop=lambda: len(asked.append(1) or asked) > 1)
    assert partial["paradigms"] == 1 and not partial["complete"]
    lm.seen.clear()
    results = blimp.run_blimp(lm, cfg, tmp_path)
    assert results["complete"] and results["pairs_scored"] == 9 and results["overall"] == 100.0
    assert len(lm.seen) == 2 * 3 * 2 * 4  # two paradigms left, 3 pairs, 2 sentences, 4 masked copies each
    assert results["per_linguistics_term"] == {"island_effects": 100.0, "subject_verb_agreement": 100.0}
    assert set(results["per_field"]) == {"morphology", "syntax"} and results["variant"] == "pll"
    lines = [json.loads(line) for line in (tmp_path / blimp.SCORES_FILE).read_text().splitlines()]
    assert sorted((r["UID"], r["pairID"]) for r in lines) == sorted(
        (uid, str(i)) for uid in ("agreement_a", "agreement_b", "island") for i in range(3)
    )
    assert json.loads((tmp_path / blimp.RESULTS_FILE).read_text())["overall"] == 100.0


def test_bad_files_and_settings_name_the_problem(tmp_path):
    from cramming.errors import ConfigError, DataSourceError

    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(DataSourceError, match="broken.jsonl.gz"):
        blimp.load_pairs(BlimpConfig(dir=str(tmp_path)))
    with pytest.raises(DataSourceError, match="no <UID>.jsonl"):
        blimp.load_pairs(BlimpConfig(dir=str(tmp_path / "empty-nowhere")))
    with pytest.raises(ConfigError, match="blimp.variant"):
        BlimpConfig(variant="l2r")


# ------------------------------------------------------------- against an independent transformers loop


def plain_pll(model, tokenizer: Tokenizer, sentence: str, mask_id: int) -> float:
    """Salazar et al.'s definition, one masked copy at a time, in transformers alone."""
    encoding = tokenizer.encode(sentence)
    total = 0.0
    for i, special in enumerate(encoding.special_tokens_mask):
        if special:
            continue
        ids = torch.tensor([encoding.ids])
        ids[0, i] = mask_id
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, i].double()
        total += torch.log_softmax(logits, dim=-1)[encoding.ids[i]].item()
    return total


def test_scores_equal_a_plain_transformers_loop_on_the_export(tmp_path):
    pytest.importorskip("transformers")
    from test_hf import TEXTS, arch, make_checkpoint
    from transformers import AutoModelForMaskedLM

    from cramming.hf.export import to_transformers
    from cramming.model.checkpoint import load_pretrained

    model, checkpoint = make_checkpoint(tmp_path / "run", arch("tiny", max_seq_length=64))
    folder = to_transformers(checkpoint, tmp_path / "hf")
    pretrained = load_pretrained(checkpoint, device="cpu")
    mask_id = pretrained.config["special_tokens"]["mask"]
    ours = blimp.pseudo_log_likelihoods(
        CrammedMaskedLM(pretrained.model, pretrained.tokenizer, mask_id), TEXTS[:6], "pll", batch_rows=7
    )
    theirs_model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).eval()
    theirs = [plain_pll(theirs_model, pretrained.tokenizer, s, mask_id) for s in TEXTS[:6]]
    # fp32 both ways, the same arithmetic in other batch shapes: each token's log-probability agrees to a few
    # fp32 ulps of the logits (|logit| < 10: ~1e-6), and a sentence sums at most 64 of them
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) < 1e-4, (ours, theirs)


# ----------------------------------------------------------------------------------------------- eval.py


def run_eval(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        str(REPO / "eval.py"),
        "eval=blimp",
        "impl.device=cpu",
        "impl.cpu_threads=1",
        *args,
    ]
    return subprocess.run(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )


@pytest.mark.slow
def test_eval_py_scores_resumes_and_reads_a_transformers_folder(tmp_path):
    pytest.importorskip("transformers")
    from test_hf import arch, make_checkpoint

    from cramming.hf.export import to_transformers

    _, checkpoint = make_checkpoint(tmp_path / "run", arch("tiny", max_seq_length=64))
    data = tmp_path / "blimp"
    data.mkdir()
    for uid in ("first", "second", "third"):
        write_paradigm(data, uid, "subject_verb_agreement", "morphology", 4)
    common = (
        f"checkpoint={checkpoint}",
        f"blimp.dir={data}",
        f"base_dir={tmp_path / 'out'}",
        "blimp.pairs_per_paradigm=3",
    )
    done = run_eval(*common, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    first = next((tmp_path / "out" / "blimp").glob("*/blimp_results.json")).parent
    results = json.loads((first / blimp.RESULTS_FILE).read_text())
    assert results["complete"] and results["pairs_scored"] == 9
    card = json.loads((first / "run_card.json").read_text())
    assert card["status"] == "ok" and card["metrics"]["blimp_overall"] == results["overall"]
    # as if stopped after one paradigm: resume=true scores the other two only, into a new folder
    scores = (first / blimp.SCORES_FILE).read_text().splitlines()
    (first / blimp.SCORES_FILE).write_text("\n".join(scores[:3]) + "\n")
    resumed = run_eval(*common, "resume=true", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert resumed.stdout.count("blimp second") + resumed.stdout.count("blimp third") == 2
    assert "blimp first:" not in resumed.stdout
    other = run_eval(*common, "resume=true", "blimp.variant=pll", cwd=tmp_path)
    assert (
        other.returncode == 2 and "variant" in other.stdout
    )  # another recipe is refused, naming the setting
    # a transformers folder (the export of the same checkpoint) scores the same pairs the same way
    folder = to_transformers(checkpoint, tmp_path / "hf")
    hf = run_eval(
        f"checkpoint=hf:{folder}", *common[1:], "name=hf", "blimp.variant=within_word_l2r", cwd=tmp_path
    )
    assert hf.returncode == 0, hf.stdout[-3000:]
    hf_results = json.loads(next((tmp_path / "out" / "hf").glob("*/blimp_results.json")).read_text())
    assert hf_results["per_uid"] == results["per_uid"]
