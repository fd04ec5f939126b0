"""``python -m kda_compile.coverage``: the CI subset of the model-coverage sweep.

A fixed list of fast families runs through :func:`run_family` in-process with
``Config(compiler="eager")`` (llama and qwen3: plain / q-k-norm GQA, fully rewritten; gemma3_text:
sliding + full layers; prophetnet: 4-D and 5-D attention (its predict stream folded into the batch dim),
fully rewritten; minimax_m3_vl_text: its default config's layers are full attention, fully rewritten (its sparse
layers: tests/models/test_minimax_m3_block_sparse.py); deepseek_v4: its compressed layers rewritten into
``compressed_sparse_attention``; reformer: its attention left alone, so the table shows a left-alone reason). Also: the tiny configs keep one layer of each kind of a hybrid, the markdown
writer on hand-made rows, a family that fails to build, times out or is unknown becomes a row or a usage error, not a crash, and the
written file reads back exactly (rows, notes, families not run) for ``--resume``, which runs only the rest.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kda_compile.coverage import Row, document, markdown_table, run_family, run_isolated, summary  # noqa: E402
from kda_compile.coverage.__main__ import main  # noqa: E402
from kda_compile.coverage.models import model_types, shrink, tiny_config  # noqa: E402
from kda_compile.coverage.stored import read_document  # noqa: E402
from kda_compile.coverage.table import COLUMNS, ROWS_BEGIN, format_row  # noqa: E402
import torch  # noqa: E402

from kda_compile.bench import e2e_kimi  # noqa: E402

CI_FAMILIES = ("llama", "qwen3", "gemma3_text", "prophetnet", "minimax_m3_vl_text", "deepseek_v4", "reformer")
ERROR_TOL = 1e-4


@pytest.fixture(scope="module")
def rows() -> dict[str, Row]:
    return {name: run_family(name) for name in CI_FAMILIES}


def test_ci_families_are_causal_lms_of_this_transformers():
    assert set(CI_FAMILIES) <= set(model_types())


def test_ci_rows_have_every_column_and_match_eager(rows):
    for name, row in rows.items():
        assert row.status == "ok", (name, row.reason)
        assert "softmax" in row.attention, (name, row.attention)
        assert row.graph_breaks is not None and row.graphs and row.graphs >= 1
        assert row.logits_error is not None and row.logits_error < ERROR_TOL, (name, row.logits_error)
        assert len(format_row(row)) == len(COLUMNS)


@pytest.mark.parametrize("name", ["llama", "qwen3", "prophetnet"])
def test_fully_rewritten_without_graph_breaks(rows, name):
    row = rows[name]
    assert row.fully_rewritten, row
    assert row.rewritten == {"kda_compile.attention": row.layers}
    assert row.graph_breaks == 0 and row.graphs == 1


def test_deepseek_v4_compressed_layers_are_rewritten(rows):
    row = rows["deepseek_v4"]
    assert row.rewritten.get("kda_compile.compressed_sparse_attention", 0) >= 1 and not row.left_alone, row
    assert "DSA" in row.attention, row.attention


def test_gemma3_keeps_a_sliding_and_a_full_layer(rows):
    assert tiny_config("gemma3_text").layer_types == ["sliding_attention", "full_attention"]
    assert rows["gemma3_text"].rewritten == {"kda_compile.attention": 2}


def test_a_family_left_alone_shows_the_reason_in_the_table(rows):
    partial = [r for r in rows.values() if r.left_alone or not r.rewritten]
    assert partial, "every CI family is fully rewritten now: pick one that is not, for the left-alone column"
    table = markdown_table(partial)
    for row in partial:
        for reason in row.left_alone:
            assert reason.split(":")[0] in table


def test_hybrid_configs_keep_one_layer_of_each_kind():
    d = {"num_hidden_layers": 8, "hidden_size": 4096, "vocab_size": 150000, "bos_token_id": 149999,
         "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
         "mlp_layer_types": ["dense"] + ["sparse"] * 7, "full_attn_idxs": [3, 7]}
    tiny = shrink(d)
    # layer 0: linear/dense, 1: linear/sparse, 3: full/sparse
    assert tiny["num_hidden_layers"] == 3
    assert tiny["layer_types"] == ["linear_attention", "linear_attention", "full_attention"]
    assert tiny["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert tiny["full_attn_idxs"] == [2]
    assert tiny["hidden_size"] == 64 and tiny["vocab_size"] == 256 and tiny["bos_token_id"] < 256
    assert shrink({"num_hidden_layers": 12, "layer_types": ["full_attention"] * 12})["num_hidden_layers"] == 2


def test_dicts_keyed_by_layer_index_follow_the_kept_layers():
    # dots3_note_text: per-layer MLA overrides keyed "02", "03"...; sizes shrunk, head_dim = nope + rope
    swa = {"num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 1024, "qk_nope_head_dim": 192}
    d = {"num_hidden_layers": 6, "qk_rope_head_dim": 64, "kv_lora_rank": 512, "num_attention_heads": 128,
         "layer_types": ["full"] * 2 + ["sliding"] * 4, "per_layer_config": {f"{i:02d}": swa for i in range(2, 6)}}
    tiny = shrink(d)
    assert tiny["num_hidden_layers"] == 2 and tiny["layer_types"] == ["full", "sliding"]
    assert tiny["per_layer_config"] == {"01": {"num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
                                               "qk_nope_head_dim": 16, "head_dim": 24}}
    # an override is a layer kind of its own; integer keys stay integers
    tiny = shrink({"num_hidden_layers": 4, "per_layer_config": {3: {"num_attention_heads": 8}},
                   "id2label": {0: "LABEL_0", 1: "LABEL_1"}})  # keyed by small ints, but no layer's
    assert tiny["num_hidden_layers"] == 2 and tiny["per_layer_config"] == {1: {"num_attention_heads": 4}}
    assert tiny["id2label"] == {0: "LABEL_0", 1: "LABEL_1"}
    cfg = tiny_config("dots3_note_text")
    assert len(cfg.layer_types) == cfg.num_hidden_layers <= 4
    # 8 indexer heads: with 2, a key's index score is exactly 0 in 1 of 4 cases, and keys tied at the
    # top-k boundary are chosen differently by torch.topk and our op (dots3_note_text's logits moved 2.6e-2)
    assert cfg.index_n_heads == 8


def test_per_layer_size_and_float_lists_follow_the_kept_layers():
    # gemma3n: one intermediate_size per layer (shrunk, no kind), a float sparsity per layer (a kind)
    d = {"num_hidden_layers": 6, "intermediate_size": [16384] * 6,
         "activation_sparsity_pattern": [0.95] * 2 + [0.0] * 4, "layer_types": ["sliding", "full"] * 3}
    tiny = shrink(d)
    assert tiny["num_hidden_layers"] == 4 and tiny["intermediate_size"] == [128] * 4
    assert tiny["activation_sparsity_pattern"] == [0.95, 0.95, 0.0, 0.0]
    assert tiny["layer_types"] == ["sliding", "full", "sliding", "full"]
    # falcon_h1: the Mamba inner width is heads x head size
    tiny = shrink({"mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_d_head": 64, "hidden_size": 4096})
    assert tiny["mamba_d_ssm"] == tiny["mamba_n_heads"] * tiny["mamba_d_head"] == 32
    # granitemoehybrid (no mamba_d_ssm): heads x head size = expand x hidden; mamba2 alike
    tiny = shrink({"mamba_expand": 2, "mamba_n_heads": 128, "mamba_d_head": 64, "hidden_size": 4096})
    assert tiny["mamba_n_heads"] * tiny["mamba_d_head"] == 2 * tiny["hidden_size"]
    tiny = shrink({"state_size": 128, "expand": 2, "num_heads": 128, "head_dim": 64, "hidden_size": 4096})
    assert tiny["num_heads"] * tiny["head_dim"] == 2 * tiny["hidden_size"]
    # gemma3n: the last num_kv_shared_layers layers (sharing earlier layers' k/v) are a kind of their own
    tiny = shrink({"num_hidden_layers": 10, "num_kv_shared_layers": 4, "layer_types": ["sliding", "full"] * 5})
    assert tiny["num_hidden_layers"] == 4 and tiny["num_kv_shared_layers"] == 2
    # recurrent_gemma: a type pattern shorter than the layers repeats over them; one layer of each type kept
    tiny = shrink({"num_hidden_layers": 26, "block_types": ["recurrent", "recurrent", "attention"]})
    assert tiny["num_hidden_layers"] == 2 and tiny["block_types"] == ["recurrent", "attention"]
    # laguna: heads per layer, cut down and shrunk like num_attention_heads
    tiny = shrink({"num_hidden_layers": 40, "num_attention_heads_per_layer": [48] * 40})
    assert tiny["num_attention_heads_per_layer"] == [4, 4]


@pytest.mark.parametrize("family", ["hunyuan_v1_dense", "ministral", "lfm2_moe", "laguna", "mamba2", "falcon_h1",
                                    "gemma4_text", "gemma3n_text", "hrm_text", "musicgen", "recurrent_gemma",
                                    "reformer", "xlstm", "blt", "cohere_compass_text"])
def test_tiny_configs_that_used_to_fail_build_and_run(family):
    # hunyuan_v1 / ministral: head_dim None in the default config; lfm2_moe: layer_types None; gemma4:
    # per_layer_config; hrm_text: num_layers_per_stack (its cache slots) derived from the tiny layer count;
    # musicgen: the causal LM is the decoder sub-config (shrunk too), 2 codebooks: the 2 rows of ids;
    # reformer: a decoder, axial position sizes; xlstm: dim factors; blt: global hidden size, no cache;
    # cohere_compass_text: RoPE parameters per layer type
    import torch

    from kda_compile.coverage.models import build_model

    model = build_model(family)
    with torch.no_grad():
        logits = model(input_ids=torch.randint(3, 200, (2, 6))).logits
    assert logits.shape[-2] == 6 and torch.isfinite(logits).all()
    assert sum(p.numel() for p in model.parameters()) < 2_000_000  # tiny


def test_markdown_writer_on_hand_made_rows():
    ok = Row("fam_a", attention=["softmax", "KDA"], layers=2, rewritten={"kda_compile.attention": 2},
             left_alone={"softmax_attention: mask | shape unknown": 3}, graph_breaks=1, graphs=2,
             logits_error=1.234e-7, seconds=4.2)
    failed = Row("fam_b", status="build failed", reason="ValueError: no tiny config")
    lines = markdown_table([ok, failed]).splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    assert len(lines) == 4
    assert lines[2] == ("| `fam_a` | ok | softmax, KDA | 2 | kda_compile.attention x2 | "
                        "softmax_attention: mask \\| shape unknown x3 | 1 (2 graphs) | 1.2e-07 | 4 |")
    assert lines[3] == "| `fam_b` | build failed: ValueError: no tiny config | - | - | - | - | - | - | 0 |"
    counts = summary([ok, failed])
    assert counts["built"] == 1 and counts["with left-alone sites"] == 1 and counts["failures"] == 1
    assert counts["fully rewritten"] == 0 and counts["with graph breaks"] == 1
    doc = document([ok, failed], command="python -m kda_compile.coverage", not_run=["fam_c"],
                   not_run_reason="stopped", versions={"torch": "x"}, date="2000-01-01")
    assert "last written by `python -m kda_compile.coverage` on 2000-01-01 with torch x." in doc
    assert "Not run (1): stopped" in doc and "`fam_c`" in doc


def _awkward_row(family: str = "fam_a", **kw) -> Row:
    """A row whose text holds what markdown and HTML comments treat specially."""
    return Row(family, attention=["softmax", "MLA"], layers=3, rewritten={"kda_compile.attention": 2},
               left_alone={"softmax_attention: a | b --> c <!-- d\nsecond line": 1, "x: y x2": 3},
               graph_breaks=2, graph_break_reasons=["model.py:12: `if x > 0` -->"], graphs=3,
               logits_error=1.2345678901234567e-07, seconds=12.34, command="python -m kda_compile.coverage --x 'a b'",
               date="2000-01-01", versions={"torch": "x"}, **kw)


def test_rows_round_trip_exactly_through_the_written_file():
    rows = [_awkward_row(), Row("fam_b", status="timeout", reason="no result within 1 s", seconds=1.0),
            _awkward_row("fam_c", reason="")]
    doc = document(rows, command="python -m kda_compile.coverage", not_run=["fam_d"], not_run_reason="stopped",
                   notes="Hand-written.\n\n- kept", date="2000-01-02")
    stored = read_document(doc)
    assert not stored.parsed
    assert stored.rows == {r.family: r for r in rows}
    assert stored.notes == "Hand-written.\n\n- kept"
    assert stored.not_run == ["fam_d"]
    # the rows are one HTML comment at the end: nothing of theirs closes it early or shows in the table
    block = doc[doc.index(ROWS_BEGIN):]
    assert block.count("-->") == 1 and block.rstrip().endswith("-->")
    assert "- `python -m kda_compile.coverage --x 'a b'` on 2000-01-01 with torch x (2): `fam_a`, `fam_c`" in doc
    assert "- an unrecorded command (1): `fam_b`" in doc


def test_a_table_without_json_rows_is_parsed_from_its_cells():
    rows = [Row("fam_a", attention=["softmax"], layers=2, rewritten={"kda_compile.attention": 2},
                left_alone={"softmax_attention: mask | shape unknown": 3}, graph_breaks=1, graphs=2,
                logits_error=1.2e-07, seconds=4.0),
            Row("fam_b", status="build failed", reason="ValueError: no: tiny | config", seconds=7.0)]
    old = ("# Model coverage\n\nGenerated by `python -m kda_compile.coverage --jobs 2` on 2000-01-01 with "
           "transformers 1.0, torch 2.0.\n\n" + markdown_table(rows) + "\n\nNot run (2): stopped\n\n`fam_c`, `fam_d`\n")
    stored = read_document(old)
    assert stored.parsed and stored.not_run == ["fam_c", "fam_d"]
    for row in rows:
        row.command, row.date = "python -m kda_compile.coverage --jobs 2", "2000-01-01"
        row.versions = {"transformers": "1.0", "torch": "2.0"}
        assert stored.rows[row.family] == row


def _fake_sweep(monkeypatch, known):
    import kda_compile.coverage.models as models
    import kda_compile.coverage.sweep as sweep

    ran = []

    def fake_run_isolated(family, timeout, threads=None, attn="eager"):
        ran.append(family)
        return Row(family, attention=["softmax"], layers=2, rewritten={"kda_compile.attention": 2}, graph_breaks=0,
                   graphs=1, logits_error=1e-7, seconds=1.0, attn=attn)

    monkeypatch.setattr(models, "model_types", lambda: list(known))
    monkeypatch.setattr(sweep, "run_isolated", fake_run_isolated)
    return ran


def test_cli_resume_keeps_finished_rows_and_runs_only_the_rest(tmp_path, monkeypatch, capsys):
    ran = _fake_sweep(monkeypatch, ["fam_a", "fam_b", "fam_c"])
    out = tmp_path / "coverage.md"
    kept = _awkward_row()
    out.write_text(document([kept], command="old", not_run=["fam_b", "fam_c"], not_run_reason="stopped",
                            notes="Kept notes."))
    assert main(["--resume", "--out", str(out)]) == 0
    assert sorted(ran) == ["fam_b", "fam_c"]
    stored = read_document(out.read_text())
    assert stored.rows["fam_a"] == kept and stored.notes == "Kept notes." and stored.not_run == []
    new = stored.rows["fam_b"]
    assert new.command == f"python -m kda_compile.coverage --resume --out {out}" and new.date and new.versions
    assert "families: 3, built: 3, compiled: 3" in capsys.readouterr().out

    ran.clear()  # --families re-runs the named rows only, replacing them
    assert main(["--resume", "--families", "fam_a", "--out", str(out)]) == 0
    stored = read_document(out.read_text())
    assert ran == ["fam_a"] and stored.rows["fam_a"] != kept and len(stored.rows) == 3


def test_cli_budget_leaves_families_listed_as_not_run(tmp_path, monkeypatch):
    ran = _fake_sweep(monkeypatch, ["fam_a", "fam_b"])
    out = tmp_path / "coverage.md"
    assert main(["--resume", "--budget", "0", "--out", str(out)]) == 0
    stored = read_document(out.read_text())
    assert ran == [] and stored.rows == {} and stored.not_run == ["fam_a", "fam_b"]
    assert "time budget (`--budget 0`) ran out" in out.read_text()


def test_an_sdpa_sweep_keeps_its_rows_apart_from_eager_ones(tmp_path, monkeypatch, capsys):
    ran = _fake_sweep(monkeypatch, ["fam_a", "fam_b"])
    out = tmp_path / "coverage-sdpa.md"
    assert main(["--attn", "sdpa", "--families", "fam_a", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Model coverage (sdpa attention)") and "fp32, SDPA attention" in text
    assert read_document(text).rows["fam_a"].attn == "sdpa"
    assert main(["--attn", "sdpa", "--resume", "--out", str(out)]) == 0 and ran == ["fam_a", "fam_b"]
    with pytest.raises(SystemExit):  # eager rows never join a file of sdpa rows
        main(["--resume", "--out", str(out)])
    assert "holds rows built with sdpa attention" in capsys.readouterr().err


def test_sdpa_models_are_built_with_sdpa_and_rewritten():
    from kda_compile.coverage.models import build_model

    assert build_model("llama", attn="sdpa").config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="attn must be one of"):
        build_model("llama", attn="flash")
    row = run_family("qwen3", attn="sdpa")
    assert row.attn == "sdpa" and row.fully_rewritten and row.logits_error < ERROR_TOL
    unsupported = run_family("gemma2", attn="sdpa")  # transformers refuses SDPA for it: a status, not a failure
    assert unsupported.status == "no such attention" and "no sdpa attention" in unsupported.reason
    assert summary([row, unsupported])["failures"] == 0 and summary([row, unsupported])["built"] == 1


def test_a_family_that_fails_to_build_becomes_a_row():
    row = run_family("no_such_model_type")
    assert row.status == "build failed" and row.reason
    assert "no_such_model_type" in markdown_table([row])


def test_a_family_over_its_time_limit_becomes_a_timeout_row():
    row = run_isolated("llama", timeout=0.5)
    assert row.status == "timeout" and row.family == "llama"


def test_cli_rejects_unknown_families(capsys):
    with pytest.raises(SystemExit):
        main(["--families", "llama,no_such_model_type"])
    assert "no_such_model_type" in capsys.readouterr().err


def test_cli_writes_the_table(tmp_path, capsys):
    out = tmp_path / "coverage.md"
    assert main(["--families", "llama", "--out", str(out), "--timeout", "120"]) == 0
    text = out.read_text()
    assert "| `llama` | ok | softmax | 2 | kda_compile.attention x2 | - | 0 (1 graphs) |" in text
    assert "families: 1, built: 1, compiled: 1, fully rewritten: 1" in capsys.readouterr().out


def test_sizes_the_config_derives_are_derived_again_from_the_tiny_sizes():
    # declared None, a number in the default config: rwkv attention_hidden_size, xlnet d_head
    assert tiny_config("rwkv").attention_hidden_size == 64
    assert tiny_config("xlnet").d_head == 16  # d_model // n_head, which xlnet validates
    xlstm = tiny_config("xlstm")
    assert (xlstm.embedding_dim, xlstm.num_blocks) == (64, xlstm.num_hidden_layers)
    # no declared field, set by the config when absent (an extra keyword would override it): zamba2
    zamba2 = tiny_config("zamba2")
    assert zamba2.mamba_headdim == zamba2.mamba_expand * zamba2.hidden_size // zamba2.n_mamba_heads
    assert zamba2.attention_hidden_size == 2 * zamba2.hidden_size


def test_unset_sizes_the_model_reads_are_filled():
    from kda_compile.coverage.models import _fill_unset

    assert _fill_unset(shrink({"num_attention_heads": 48, "num_key_value_heads": None}))["num_key_value_heads"] == 4
    moe = _fill_unset(shrink({"moe_intermediate_size": 1408, "n_routed_experts": None, "n_shared_experts": None,
                              "num_experts_per_tok": None}))
    assert (moe["n_routed_experts"], moe["n_shared_experts"], moe["num_experts_per_tok"]) == (4, 1, 2)
    assert _fill_unset({"num_experts_per_tok": None})["num_experts_per_tok"] is None  # not a MoE config


def test_a_top_1_router_stays_top_1():
    assert shrink({"num_experts_per_tok": 1, "num_experts": 16})["num_experts_per_tok"] == 1
    assert shrink({"num_experts_per_tok": 8, "num_experts": 64})["num_experts_per_tok"] == 2


def test_a_hybrid_without_attention_layer_gets_one():
    from kda_compile.coverage.models import _fill_unset

    linear = _fill_unset(shrink({"num_hidden_layers": 32, "layer_types": ["linear_attention"] * 32}))
    assert linear["layer_types"] == ["linear_attention", "full_attention"]
    assert _fill_unset(shrink({"num_hidden_layers": 32, "attn_layer_indices": None}))["attn_layer_indices"] == [1]
    assert tiny_config("bamba").layers_block_type == ["linear_attention", "full_attention"]


def test_an_unset_default_language_is_the_first_language():
    from kda_compile.coverage.models import _fill_unset

    assert _fill_unset({"languages": ["en_XX", "de_DE"], "default_language": None})["default_language"] == "en_XX"


def test_zamba_keeps_two_hybrid_layers_for_its_tied_shared_transformer():
    assert tiny_config("zamba").layers_block_type == ["linear_attention", "hybrid", "hybrid"]


def test_settings_the_model_needs_beyond_sizes():
    from kda_compile.coverage.models import _fill_unset

    types = ["sliding_attention", "full_attention"]
    rope = _fill_unset({"hidden_size": 64, "rope_parameters": {}, "layer_types": types})["rope_parameters"]
    assert list(rope) == types and rope["full_attention"]["rope_type"] == "default"
    factors = _fill_unset({"hidden_size": 64, "qk_dim_factor": 0.5, "v_dim_factor": 1.0})
    assert (factors["qk_dim_factor"], factors["v_dim_factor"]) == (1.0, 1.0)
    assert _fill_unset({"hidden_size": 128, "qk_dim_factor": 0.5})["qk_dim_factor"] == 0.5  # 64: no rounding
    axial = _fill_unset({"hidden_size": 64, "max_position_embeddings": 256, "axial_pos_embds_dim": [64, 192],
                         "axial_pos_shape": [64, 64]})
    assert axial["axial_pos_embds_dim"] == (16, 48) and axial["axial_pos_shape"] == (16, 16)
    assert tiny_config("reformer").is_decoder and tiny_config("reformer").axial_pos_shape == (16, 16)
    assert tiny_config("blt").use_cache is False and not tiny_config("bert-generation").is_decoder
    assert shrink({"hidden_size_global": 2048, "encoder_hash_byte_group_vocab": 500002}) == {
        "hidden_size_global": 64, "encoder_hash_byte_group_vocab": 256}


def test_an_invalid_default_config_is_built_valid():
    """gemma4_assistant's default text config is the backbone's, which its own validation rejects."""
    text = tiny_config("gemma4_assistant").text_config
    assert text.hidden_size_per_layer_input == 0 and text.vocab_size_per_layer_input == 0
    assert text.num_kv_shared_layers == text.num_hidden_layers  # every layer reads the backbone's keys / values


def test_a_missing_package_reason_drops_the_install_hint():
    from kda_compile.coverage.sweep import _first_line

    exc = ImportError("\nTimmWrapperModel requires the timm library but it was not found in your environment. You can "
                      "install it with pip:\n`pip install timm`.")
    assert _first_line(exc) == ("ImportError: TimmWrapperModel requires the timm library but it was not found in "
                                "your environment")


def test_attention_kinds_name_kda_layers_by_class_or_by_the_op_they_became():
    """Kimi-Linear's and Bailing's KDA classes end in "DeltaAttention"; glm5_next's is "...LinearAttention" (a
    name the sweep reads as "other"), so its rewritten chunk_kda sites say KDA."""
    from kda_compile.coverage.sweep import attention_kinds, with_rewritten_kinds

    kimi = e2e_kimi.build_model(e2e_kimi.TINY, 4, "cpu", torch.float32)
    assert attention_kinds(kimi) == ["MLA", "KDA"]
    assert with_rewritten_kinds(["softmax", "other"], {"kda_compile.ops.chunk_kda": 1}) == ["softmax", "KDA"]
    assert with_rewritten_kinds(["softmax", "KDA", "other"], {"kda_compile.ops.chunk_kda": 1}) == \
        ["softmax", "KDA", "other"]  # a named delta-rule layer leaves "other" to another mixer (a hybrid's Mamba)
    assert with_rewritten_kinds(["softmax"], {"kda_compile.attention": 2}) == ["softmax"]
