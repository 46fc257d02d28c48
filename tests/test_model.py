"""The crammed BERT: shapes, parameter counts, sparse = dense prediction, attention/LayerNorm backends."""

from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from kernel_checks import sum_rtol
from omegaconf import OmegaConf

from cramming.model import (
    IGNORE_INDEX,
    ArchConfig,
    BertForMLM,
    KernelUnavailableError,
    bert,
    build_model,
    count_parameters,
    kernels_by_name,
    ops,
)
from cramming.model.ops import ATTENTION, alibi_bias, resolve_kernels

CONF = Path(__file__).resolve().parent.parent / "conf" / "arch"
VOCAB = 1000


def arch_from_yaml(name: str, **overrides) -> ArchConfig:
    cfg = OmegaConf.merge(OmegaConf.structured(ArchConfig), OmegaConf.load(CONF / f"{name}.yaml"), overrides)
    return OmegaConf.to_object(cfg)


def tiny(**overrides) -> ArchConfig:
    return arch_from_yaml("tiny", **overrides)


# post-LN, biases, plain GELU, learned positions, token types, head transform: every switch flipped
SMALL_BERT_BASE = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_heads": 4,
    "intermediate_size": 64,
    "max_seq_length": 64,
}


def mlm_batch(batch=3, seq=16, vocab=VOCAB, fraction=0.25):
    input_ids = torch.randint(5, vocab, (batch, seq))
    labels = torch.where(torch.rand(batch, seq) < fraction, input_ids, IGNORE_INDEX)
    labels[:, 0] = input_ids[:, 0]  # at least one prediction per row
    return input_ids, labels


@pytest.mark.parametrize(
    ("name", "vocab", "expected_millions"),
    [
        ("crammed-bert", 32768, 119.6),
        ("bert-base", 30522, 109.5),  # BERT-base MLM without the pooler
        # 4 x (4 x 512^2 attention + 512 x 2048 gated input + 1024 x 512 output) + 8192 x 512 tied embedding
        ("bert-small", 8192, 14.7),
    ],
)
def test_parameter_count_of_the_real_configs(name, vocab, expected_millions):
    with torch.device("meta"):
        model = BertForMLM(arch_from_yaml(name), vocab)
    assert count_parameters(model) / 1e6 == pytest.approx(expected_millions, abs=0.1)


def test_crammed_bert_has_no_biases_and_ties_the_decoder():
    with torch.device("meta"):
        model = BertForMLM(arch_from_yaml("crammed-bert"), 32768)
    linear_biases = [
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.bias is not None
    ]
    assert linear_biases == []
    assert model.head.decoder.weight is model.encoder.embeddings.word.weight
    assert model.encoder.blocks[0].ffn.down.in_features == 1536  # gated: 3072 -> gate x GELU(value) of 1536


def test_layernorm_bias_is_switchable():
    model = BertForMLM(tiny(norm_bias=False), VOCAB)
    norms = [m for m in model.modules() if type(m).__name__ == "LayerNorm"]
    assert norms and all(m.bias is None for m in norms)
    assert count_parameters(model) == count_parameters(BertForMLM(tiny(), VOCAB)) - sum(
        m.weight.numel() for m in norms
    )
    input_ids, labels = mlm_batch()
    model(input_ids, labels).loss.backward()


@pytest.mark.parametrize("variant", ["tiny", "bert-base-shape"])
def test_shapes_forward_and_backward(variant):
    arch = tiny() if variant == "tiny" else arch_from_yaml("bert-base", **SMALL_BERT_BASE)
    model = BertForMLM(arch, VOCAB)
    input_ids, labels = mlm_batch()
    hidden = model.encoder(input_ids)
    assert hidden.shape == (3, 16, arch.hidden_size)
    out = model(input_ids, labels)
    n_masked = int((labels != IGNORE_INDEX).sum())
    assert out.logits.shape == (n_masked, VOCAB)
    assert out.labels.shape == (n_masked,)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
    # an untrained model predicts near-uniformly: loss close to log(vocab)
    assert out.loss.item() == pytest.approx(torch.log(torch.tensor(float(VOCAB))).item(), rel=0.1)


@pytest.mark.parametrize("variant", ["tiny", "bert-base-shape"])
def test_sparse_prediction_equals_dense_prediction_on_masked_positions(variant):
    arch = tiny() if variant == "tiny" else arch_from_yaml("bert-base", **SMALL_BERT_BASE)
    sparse = BertForMLM(dataclasses.replace(arch, sparse_prediction=True), VOCAB, dropout=0.0)
    dense = BertForMLM(dataclasses.replace(arch, sparse_prediction=False), VOCAB, dropout=0.0)
    dense.load_state_dict(sparse.state_dict())
    input_ids, labels = mlm_batch()
    out_sparse, out_dense = sparse(input_ids, labels), dense(input_ids, labels)
    assert out_dense.logits.shape == (3 * 16, VOCAB)
    masked = out_dense.labels != IGNORE_INDEX
    torch.testing.assert_close(out_sparse.logits, out_dense.logits[masked], rtol=1e-5, atol=1e-5)
    # the encoder runs the same ops on the same inputs; the loss is a mean over the masked rows (sparse) or
    # over every row with the unmasked ones ignored (dense): the same terms summed in another order, each a
    # log-sum-exp over the vocabulary, so they may differ by what sum_rtol allows for those two sums
    loss_rtol = sum_rtol(out_dense.logits.shape[0]) + sum_rtol(VOCAB)
    torch.testing.assert_close(out_sparse.loss, out_dense.loss, rtol=1e-6 + loss_rtol, atol=1e-6)
    out_sparse.loss.backward()
    out_dense.loss.backward()
    for (name, p_sparse), p_dense in zip(sparse.named_parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(p_sparse.grad, p_dense.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("with_padding", [False, True])
def test_attention_backends_agree(with_padding):
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    mask = None
    if with_padding:
        mask = torch.ones(2, 7, dtype=torch.bool)
        mask[1, 4:] = False
    reference = ATTENTION["eager"](q, k, v, mask, 0.0)
    torch.testing.assert_close(ATTENTION["sdpa"](q, k, v, mask, 0.0), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_padding", [False, True])
def test_attention_backends_agree_with_alibi(with_padding):
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    slopes = torch.tensor([1.0, 0.0, 0.25])
    mask = None
    if with_padding:
        mask = torch.ones(2, 7, dtype=torch.bool)
        mask[1, 4:] = False
    reference = ATTENTION["eager"](q, k, v, mask, 0.0, slopes)
    torch.testing.assert_close(ATTENTION["sdpa"](q, k, v, mask, 0.0, slopes), reference, rtol=1e-5, atol=1e-5)
    # the bias changes the result: the test is not vacuous
    assert not torch.allclose(reference, ATTENTION["eager"](q, k, v, mask, 0.0))


def test_alibi_bias_is_minus_slope_times_distance():
    model = BertForMLM(tiny(attention_bias="alibi", num_heads=2), VOCAB)
    slopes = model.encoder.blocks[0].attention.slopes
    bias = alibi_bias(slopes, 4)
    assert bias.shape == (2, 4, 4) and slopes.dtype == torch.float32
    torch.testing.assert_close(bias[0, 0], torch.tensor([0.0, -1.0, -2.0, -3.0]))
    torch.testing.assert_close(bias[1, 3], torch.tensor([-0.75, -0.5, -0.25, 0.0]))  # slope 1/4
    assert BertForMLM(tiny(), VOCAB).encoder.blocks[0].attention.slopes is None
    assert not any("slopes" in key for key in model.state_dict())  # rebuilt from the arch, never saved


def test_alibi_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="arch.alibi_slopes"):
        tiny(attention_bias="alibi", num_heads=2, alibi_slopes=[1.0])
    with pytest.raises(ValueError, match="arch.attention_bias"):
        tiny(attention_bias="rotary")


@pytest.mark.parametrize("attention_bias", ["none", "alibi"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_padded_tokens_do_not_change_real_ones(attention, attention_bias):
    kernels = kernels_by_name(attention=attention)
    model = BertForMLM(tiny(attention_bias=attention_bias), VOCAB, dropout=0.0, kernels=kernels).eval()
    input_ids = torch.randint(5, VOCAB, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    other = input_ids.clone()
    other[1, 8:] = torch.randint(5, VOCAB, (4,))
    a, b = model.encoder(input_ids, mask), model.encoder(other, mask)
    torch.testing.assert_close(a[1, :8], b[1, :8])
    assert not torch.allclose(a[1, 8:], b[1, 8:])


def test_the_model_file_imports_torch_alone():
    """An export carries bert.py as it is, beside the transformers wrapper: it must run with torch alone."""
    tree = ast.parse(Path(bert.__file__).read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    roots = {
        alias.name.split(".")[0] for node in imports if isinstance(node, ast.Import) for alias in node.names
    }
    roots |= {
        node.module.split(".")[0] for node in imports if isinstance(node, ast.ImportFrom) and node.module
    }
    assert all(node.level == 0 for node in imports if isinstance(node, ast.ImportFrom))
    assert roots <= {"__future__", "collections", "dataclasses", "math", "torch"}, roots


def test_sinusoidal_positions_are_not_saved_but_their_scale_is():
    keys = BertForMLM(tiny(), VOCAB).state_dict().keys()
    assert "encoder.embeddings.position.scale" in keys
    assert not any(k.endswith("position.table") for k in keys)


def test_triton_falls_back_with_one_warning_on_cpu(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with caplog.at_level(logging.WARNING, logger="cramming"):
        chosen = resolve_kernels(
            {"attention": "triton", "layernorm": "triton"}, torch.device("cpu"), strict=False
        )
    assert chosen == {"attention": "sdpa", "layernorm": "torch"}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "impl.attention=triton" in warnings[0].message and "impl.layernorm=triton" in warnings[0].message


def test_triton_strict_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailableError, match="strict_kernels"):
        build_model(tiny(), VOCAB, attention="triton", strict_kernels=True)


def test_missing_kernel_module_falls_back(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(ops._TRITON_MODULES, "attention", "no.such.module")
    with caplog.at_level(logging.WARNING, logger="cramming"):
        chosen = resolve_kernels({"attention": "triton"}, torch.device("cpu"), strict=False)
    assert chosen == {"attention": "sdpa"}
    assert "cannot import no.such.module" in caplog.text


def test_pytorch_backends_log_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="cramming"):
        requested = {"attention": "eager", "layernorm": "torch", "ffn_activation": "torch", "loss": "torch"}
        assert resolve_kernels(requested, torch.device("cpu"), strict=True) == requested
    assert caplog.records == []


def test_parity_with_hugging_face_bert():
    """Our bert-base shape with Hugging Face's BertForMaskedLM weights gives the same logits."""
    transformers = pytest.importorskip("transformers")
    arch = arch_from_yaml("bert-base", **SMALL_BERT_BASE, sparse_prediction=False)
    hf_config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        intermediate_size=arch.intermediate_size,
        max_position_embeddings=arch.max_seq_length,
        type_vocab_size=arch.type_vocab_size,
        layer_norm_eps=arch.norm_eps,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        hidden_act="gelu",
    )
    hf = transformers.BertForMaskedLM(hf_config).eval()
    ours = BertForMLM(arch, VOCAB, dropout=0.0).eval()
    ours.load_state_dict(hf_to_ours(hf.state_dict(), arch.num_layers))

    input_ids, labels = mlm_batch(batch=2, seq=10)
    token_types = torch.randint(0, 2, (2, 10))
    with torch.no_grad():
        expected = hf(input_ids=input_ids, token_type_ids=token_types).logits
        got = ours(input_ids, labels, token_type_ids=token_types).logits
    torch.testing.assert_close(got, expected.flatten(0, 1), rtol=1e-4, atol=1e-4)


def hf_to_ours(sd: dict, num_layers: int) -> dict:
    out = {
        "encoder.embeddings.word.weight": sd["bert.embeddings.word_embeddings.weight"],
        "encoder.embeddings.position.table.weight": sd["bert.embeddings.position_embeddings.weight"],
        "encoder.embeddings.token_type.weight": sd["bert.embeddings.token_type_embeddings.weight"],
        "encoder.embeddings.norm.weight": sd["bert.embeddings.LayerNorm.weight"],
        "encoder.embeddings.norm.bias": sd["bert.embeddings.LayerNorm.bias"],
        "head.transform.0.weight": sd["cls.predictions.transform.dense.weight"],
        "head.transform.0.bias": sd["cls.predictions.transform.dense.bias"],
        "head.transform.2.weight": sd["cls.predictions.transform.LayerNorm.weight"],
        "head.transform.2.bias": sd["cls.predictions.transform.LayerNorm.bias"],
        "head.decoder.weight": sd["bert.embeddings.word_embeddings.weight"],
        "head.decoder.bias": sd["cls.predictions.bias"],
    }
    for i in range(num_layers):
        hf, us = f"bert.encoder.layer.{i}.", f"encoder.blocks.{i}."
        for kind in ("weight", "bias"):
            out[us + f"attention.qkv.{kind}"] = torch.cat(
                [sd[hf + f"attention.self.{name}.{kind}"] for name in ("query", "key", "value")]
            )
            out[us + f"attention.out.{kind}"] = sd[hf + f"attention.output.dense.{kind}"]
            out[us + f"norm1.{kind}"] = sd[hf + f"attention.output.LayerNorm.{kind}"]
            out[us + f"ffn.up.{kind}"] = sd[hf + f"intermediate.dense.{kind}"]
            out[us + f"ffn.down.{kind}"] = sd[hf + f"output.dense.{kind}"]
            out[us + f"norm2.{kind}"] = sd[hf + f"output.LayerNorm.{kind}"]
    return out


@pytest.mark.parametrize("attention_bias", ["none", "alibi"])
def test_model_with_triton_kernels_matches_pytorch(monkeypatch, attention_bias):
    """The dispatch wiring: the same weights through the Triton kernels (interpreted on CPU) and PyTorch;
    with ALiBi the kernel gets the slopes, SDPA the dense bias."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    for module in ("cramming.kernels.attention", "cramming.kernels.layernorm"):
        if ops.triton_unavailable(module, torch.device("cuda" if torch.cuda.is_available() else "cpu")):
            pytest.skip(f"{module} cannot run here")
    arch = tiny(
        num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64, attention_bias=attention_bias
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reference = build_model(arch, 64, device=device, dropout=0.0)
    kernels = build_model(
        arch, 64, device=device, dropout=0.0, attention="triton", layernorm="triton", strict_kernels=True
    )
    kernels.load_state_dict(reference.state_dict())
    input_ids, labels = (t.to(device) for t in mlm_batch(batch=2, seq=16, vocab=64))
    mask = torch.ones(2, 16, dtype=torch.bool, device=device)
    mask[1, 11:] = False
    out_ref, out_kernels = reference(input_ids, labels, mask), kernels(input_ids, labels, mask)
    torch.testing.assert_close(out_kernels.loss, out_ref.loss, rtol=1e-4, atol=1e-4)
    out_ref.loss.backward()
    out_kernels.loss.backward()
    for (name, p_ref), p_kernels in zip(reference.named_parameters(), kernels.parameters(), strict=True):
        torch.testing.assert_close(p_kernels.grad, p_ref.grad, rtol=1e-3, atol=1e-4, msg=name)


def crammed_bert_shape() -> ArchConfig:
    """crammed-bert's every switch at its real widths, two layers deep (the graph repeats per layer)."""
    return arch_from_yaml("crammed-bert", num_layers=2)


def counted_batch(arch: ArchConfig, rows: int = 3, seq: int = 32, k: int = 8):
    """Rows with exactly k labelled positions each, except the last row (fewer: a row short of maskable
    tokens), as count masking makes them."""
    input_ids = torch.randint(5, VOCAB, (rows, seq))
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for row in range(rows):
        chosen = torch.randperm(seq)[: k if row < rows - 1 else k // 2]
        labels[row, chosen] = input_ids[row, chosen]
    return input_ids, labels, k


@pytest.mark.parametrize("make_arch", [tiny, crammed_bert_shape], ids=["tiny", "crammed-bert"])
def test_static_sparse_prediction_equals_the_dynamic_one(make_arch):
    model = BertForMLM(make_arch(), VOCAB, dropout=0.0)
    input_ids, labels, k = counted_batch(model.arch)
    dynamic = model(input_ids, labels)
    static = model(input_ids, labels, predicted_per_row=k)
    assert static.logits.shape == (3 * k, VOCAB)  # fixed: rows x k, whatever the labels
    # the same positions' logits (in another order) and one loss: fp32 sums over the same terms
    assert sorted(static.labels[static.labels != IGNORE_INDEX].tolist()) == sorted(dynamic.labels.tolist())
    torch.testing.assert_close(static.loss, dynamic.loss, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make_arch", [tiny, crammed_bert_shape], ids=["tiny", "crammed-bert"])
def test_training_forward_and_loss_is_one_graph(make_arch):
    """Count masking's static sparse prediction: no data-dependent shape, no graph break (with the
    boolean selection, dynamo split the forward at aten.nonzero: 3 graphs, 2 breaks)."""
    model = BertForMLM(make_arch(), VOCAB, dropout=0.0)
    input_ids, labels, k = counted_batch(model.arch)

    def loss(input_ids, labels):
        return model(input_ids, labels, predicted_per_row=k).loss

    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)(input_ids, labels)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(input_ids, labels), loss(input_ids, labels), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_crammings_small_recipe_details():
    """The [PAD] row starts at zero and gets no gradient; weight decay reaches every weight except norms and
    biases, the scaled-sinusoid position scale included (cramming's grouping)."""
    from cramming.optim import param_groups

    model = BertForMLM(arch_from_yaml("bert-base", **SMALL_BERT_BASE), VOCAB, dropout=0.0)
    word = model.encoder.embeddings.word
    assert word.padding_idx == 0 and torch.all(word.weight[0] == 0)
    input_ids, labels = mlm_batch()
    input_ids[:, -2:] = 0  # padded positions
    model(input_ids, labels, attention_mask=input_ids != 0).loss.backward()
    # tied: the decoder's [PAD] logit still trains the row; the embedding lookup alone would not
    untied = BertForMLM(
        arch_from_yaml("bert-base", **SMALL_BERT_BASE, tie_embeddings=False), VOCAB, dropout=0.0
    )
    untied(input_ids, labels, attention_mask=input_ids != 0).loss.backward()
    assert torch.all(untied.encoder.embeddings.word.weight.grad[0] == 0)

    crammed = BertForMLM(tiny(), VOCAB, dropout=0.0)
    decay, no_decay = param_groups(crammed, 0.01)
    names = {id(p): n for n, p in crammed.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    not_decayed = {names[id(p)] for p in no_decay["params"]}
    assert "encoder.embeddings.position.scale" in decayed
    assert all("norm" in n for n in not_decayed) and "encoder.final_norm.weight" in not_decayed
    assert decayed | not_decayed == set(names.values())
