from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from launchers import llama_server
from launchers.llama_help import choices, help_text, options
from launchers.spec import group_name, ports_in_file, program_name, render_replica, replica_index
from proxy.config.checks import model_properties
from proxy.config.files import REPO_ROOT
from proxy.config.model import ModelConfig

GOLDEN = Path(__file__).parent / "golden"
ENVIRON = {"LD_LIBRARY_PATH": "/usr/local/lib"}


def model(name: str = "gemma-4-26b-a4b-it-ud-q5ks-llama-server", **options: object) -> ModelConfig:
    base = {
        "backend": "llama_server",
        "model_path": "/models/gemma-4-26B-A4B-it-UD-Q5_K_S.gguf",
        "llama_server_binary": "/opt/llama.cpp/bin/llama-server",
        "llama_server_library_path": ["/opt/llama.cpp/lib"],
        "llama_server_n_ctx": 4096,
        "llama_server_n_gpu_layers": "-1",
        "llama_server_flash_attn": "on",
        "llama_server_mmproj_path": "/models/mmproj-model-f16.gguf",
        "llama_server_image_max_tokens": 512,
        "llama_server_draft_model_path": "/models/draft 50% small.gguf",
        "llama_server_spec_type": "draft",
        "llama_server_spec_draft_n_max": 5,
        "llama_server_spec_draft_p_min": 0.1,
        "llama_server_spec_draft_ngl": "-1",
        "llama_server_reasoning": "none",
        "llama_server_embeddings": True,
        "llama_server_pooling": "mean",
        "llama_server_media_path": "/srv/media",
        "llama_server_extra_args": ["--threads", "8"],
        "enable_thinking": False,
        **options,
    }
    return ModelConfig(name=name, backend="llama_server", enabled=True, replicas=2, replica_max=2,
                       target_inflight=2, modalities=("text", "image"), gpus=(0, 1), options=base)


def render(cfg: ModelConfig) -> str:
    specs = [llama_server.launch(cfg, i, 18100 + i, 15, ENVIRON) for i in range(cfg.replicas)]
    # One file per replica (programs/<program>.conf); the golden holds them one after the other.
    return "\n".join(render_replica(cfg.name, s, Path("/state/logs")) for s in specs)


def test_render_matches_golden() -> None:
    text = render(model())
    golden = GOLDEN / "llama_server.conf"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_render_is_byte_identical_for_the_same_input() -> None:
    assert render(model()) == render(model())


def test_every_field_maps_to_its_flag() -> None:
    argv = llama_server.argv(model(), "127.0.0.1", 18100)
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--model"] == "/models/gemma-4-26B-A4B-it-UD-Q5_K_S.gguf"
    assert pairs["--ctx-size"] == "8192"  # 4096 for each of the 2 slots
    assert pairs["--n-gpu-layers"] == "-1"
    assert pairs["--flash-attn"] == "on"
    assert pairs["--mmproj"] == "/models/mmproj-model-f16.gguf"
    assert pairs["--image-max-tokens"] == "512"
    assert pairs["--spec-draft-model"] == "/models/draft 50% small.gguf"
    assert pairs["--spec-type"] == "draft-simple"  # the seed's `draft`, as the pinned build names it
    assert pairs["--spec-draft-n-max"] == "5"
    assert pairs["--spec-draft-p-min"] == "0.1"
    assert pairs["--spec-draft-ngl"] == "-1"
    assert pairs["--reasoning-format"] == "none"
    assert pairs["--reasoning"] == "off"
    assert pairs["--pooling"] == "mean"
    assert pairs["--media-path"] == "/srv/media"
    assert "--embeddings" in argv
    assert pairs["--alias"] == "gemma-4-26b-a4b-it-ud-q5ks-llama-server"
    assert pairs["--parallel"] == "2"
    assert argv[-2:] == ("--threads", "8")


def test_environment_pins_gpus_and_prepends_library_path() -> None:
    spec = llama_server.launch(model(), 0, 18100, 15, ENVIRON)
    assert dict(spec.env) == {"CUDA_VISIBLE_DEVICES": "0,1", "LD_LIBRARY_PATH": "/opt/llama.cpp/lib:/usr/local/lib"}


def test_unset_fields_add_no_flags() -> None:
    cfg = ModelConfig(name="m", backend="llama_server", enabled=True, replicas=1, replica_max=1, target_inflight=1,
                      modalities=("text",), gpus=(), options={"model_path": "/m.gguf",
                                                              "llama_server_binary": "/bin/llama-server"})
    spec = llama_server.launch(cfg, 0, 18100, 15, {})
    assert spec.argv == ("/bin/llama-server", "--model", "/m.gguf", "--host", "127.0.0.1", "--port", "18100",
                         "--alias", "m", "--parallel", "1", "--metrics", "--no-webui", "--kv-unified")
    assert spec.env == ()


@pytest.mark.parametrize("n_ctx, slots, expected", [(2048, 4, ["--ctx-size", "8192"]),
                                                     (4096, 1, ["--ctx-size", "4096"]),
                                                     (None, 4, ["--kv-unified"]), (0, 2, ["--kv-unified"])])
def test_n_ctx_is_the_context_of_one_request(n_ctx: int | None, slots: int, expected: list[str]) -> None:
    # llama-server divides --ctx-size over its --parallel slots; the field is per request.
    cfg = replace(model(llama_server_n_ctx=n_ctx), target_inflight=slots)
    argv = llama_server.argv(cfg, "127.0.0.1", 18100)
    i = argv.index(expected[0])
    assert list(argv[i:i + len(expected)]) == expected
    assert argv[argv.index("--parallel") + 1] == str(slots)


@pytest.mark.parametrize("seed_value, flag_value", [("draft", "draft-simple"), ("mtp", "draft-mtp"),
                                                    ("draft-simple", "draft-simple"), ("ngram-mod", "ngram-mod"),
                                                    ("draft,ngram-mod", "draft-simple,ngram-mod")])
def test_spec_types_map_to_the_pinned_builds_names(seed_value: str, flag_value: str) -> None:
    argv = llama_server.argv(model(llama_server_spec_type=seed_value), "127.0.0.1", 18100)
    assert argv[argv.index("--spec-type") + 1] == flag_value


HELP = """----- common params -----

-h,    --help, --usage                  print usage and exit
-c,    --ctx-size N                     size of the prompt context (default: 0, 0 = loaded from model)
-fa,   --flash-attn [on|off|auto]       set Flash Attention use ('on', 'off', or 'auto', default: 'auto')
--pooling {none,mean,cls,last,rank}     pooling type for embeddings, use model default if unspecified
--spec-type none,draft-simple,draft-mtp,ngram-mod
                                        comma-separated list of types of speculative decoding to use
--reasoning-format FORMAT               controls whether thought tags are allowed; one of:
                                        - none: leaves thoughts unparsed in `message.content`
                                        - deepseek: puts thoughts in `message.reasoning_content`
                                        (default: auto)
--embedding, --embeddings               restrict to only support embedding use case
--port PORT                             port to listen (default: 8080) see also --ctx-size
"""


def test_help_is_read_into_whole_flags_and_their_values() -> None:
    opts = options(HELP)
    assert {"-c", "--ctx-size", "-fa", "--flash-attn", "--pooling", "--spec-type", "--reasoning-format",
            "--embedding", "--embeddings", "--port", "-h", "--help", "--usage"} == set(opts)
    assert choices(opts["--flash-attn"]) == {"on", "off", "auto"}
    assert choices(opts["--pooling"]) == {"none", "mean", "cls", "last", "rank"}
    assert choices(opts["--spec-type"]) == {"none", "draft-simple", "draft-mtp", "ngram-mod"}
    assert choices(opts["--reasoning-format"]) == {"none", "deepseek", "auto"}
    assert choices(opts["--ctx-size"]) is None and choices(opts["--embeddings"]) is None


def test_help_is_read_once_per_binary_and_again_when_it_changes(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\necho run >> {calls}\ncat <<'EOF'\n{HELP}EOF\n")
    exe.chmod(0o755)
    cache = tmp_path / "cache"
    assert help_text(exe, cache) == HELP
    assert help_text(exe, cache) == HELP
    assert calls.read_text().count("run") == 1
    os.utime(exe, ns=(1, 1))  # another build at the same path
    help_text(exe, cache)
    assert calls.read_text().count("run") == 2


def test_values_the_binary_refuses_are_config_errors_listing_what_it_accepts(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_POOL_CACHE_DIR", str(tmp_path / "cache"))
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\ncat <<'EOF'\n{HELP}EOF\n")
    exe.chmod(0o755)
    ok = model(llama_server_binary=str(exe), llama_server_spec_type="draft", llama_server_reasoning=None,
               llama_server_extra_args=[])
    assert llama_server.option_problems(ok) == []
    bad = model(llama_server_binary=str(exe), llama_server_spec_type="draft-eagle3", llama_server_reasoning=None,
                llama_server_extra_args=[])
    (problem,) = llama_server.option_problems(bad)
    assert problem == (f"engine.models.{bad.name}.llama_server_spec_type: 'draft-eagle3' is not accepted by {exe} "
                       "(--spec-type draft-eagle3); it accepts: draft-mtp, draft-simple, ngram-mod, none")


def _built_help(llama_server_bin: Path) -> str:
    return subprocess.run([str(llama_server_bin), "--help"], capture_output=True, text=True, timeout=60).stdout


def test_flags_exist_in_the_built_llama_server(llama_server_bin: Path) -> None:
    known = options(_built_help(llama_server_bin))
    argv = llama_server.argv(model(), "127.0.0.1", 18100)
    flags = {a for a in argv if a.startswith("--")} - {"--threads"}
    missing = sorted(f for f in flags if f not in known)  # whole flags: `--ctx` would not match `--ctx-size`
    assert not missing, missing
    unified = llama_server.argv(model(llama_server_n_ctx=None), "127.0.0.1", 18100)
    assert "--kv-unified" in unified and "--kv-unified" in known


def test_every_enumerated_value_is_accepted_by_the_built_llama_server(llama_server_bin: Path) -> None:
    schema = json.loads((REPO_ROOT / "conf" / "schema.json").read_text())["$defs"]["model"]["properties"]
    known = options(_built_help(llama_server_bin))
    for key, flag in llama_server.ENUM_FIELDS:
        accepted = choices(known[flag])
        assert accepted, flag
        values = [v for v in schema[key].get("enum", []) if v is not None]
        if key == "llama_server_spec_type":
            values = list(llama_server.SPEC_TYPE_NAMES)
        if key == "llama_server_reasoning":
            values = ["none"]  # the seed's value
        for value in values:
            flag_value = llama_server.argv(model(**{key: value}), "h", 1)
            given = flag_value[flag_value.index(flag) + 1]
            assert set(given.split(",")) <= accepted, (key, value, given, sorted(accepted))


def test_the_seed_example_passes_the_built_binarys_check(llama_server_bin: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_POOL_CACHE_DIR", str(tmp_path))
    cfg = model(llama_server_binary=str(llama_server_bin))   # the seed's fields, spec type `draft`
    assert llama_server.option_problems(cfg) == []
    (problem,) = llama_server.option_problems(model(llama_server_binary=str(llama_server_bin),
                                                    llama_server_spec_type="draft-turbo"))
    assert "'draft-turbo' is not accepted" in problem and "draft-simple" in problem and "draft-mtp" in problem


@pytest.mark.parametrize("name", ["demo", "Qwen/Qwen2.5", "a b;rm -rf /", "x" * 128, "gemma:7b@q4+x"])
def test_program_names_are_safe_and_distinct(name: str) -> None:
    group = group_name(name)
    assert all(c.isalnum() or c == "-" for c in group) and len(group) <= 49
    assert program_name(name, 1) == f"{group}-r1"
    assert group_name(name + "_") != group
    assert replica_index(name, program_name(name, 12)) == 12
    assert replica_index(name, group) is None and replica_index(name + "_", program_name(name, 0)) is None


def test_ports_are_read_back_from_a_rendered_file() -> None:
    cfg = model()
    assert ports_in_file(render(cfg)) == {program_name(cfg.name, 0): 18100, program_name(cfg.name, 1): 18101}


def _help_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLM_POOL_CACHE_DIR", str(tmp_path / "cache"))
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\ncat <<'EOF'\n{HELP}EOF\n")
    exe.chmod(0o755)
    return exe


def test_model_files_must_be_gguf_files_not_folders_or_other_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  tiny_gguf: Path) -> None:
    exe = _help_binary(tmp_path, monkeypatch)

    def cfg(**options: object) -> ModelConfig:
        return model(**{"llama_server_binary": str(exe), "llama_server_mmproj_path": None,
                        "llama_server_media_path": None, "llama_server_draft_model_path": None,
                        "llama_server_extra_args": [], **options})

    name = model().name
    assert llama_server.check(cfg(model_path=str(tiny_gguf))) == []
    folder = tmp_path / "models"
    folder.mkdir()
    assert llama_server.check(cfg(model_path=str(folder))) == \
        [f"engine.models.{name}.model_path: {folder} is a folder; backend 'llama_server' needs a GGUF file"]
    yaml_file = tmp_path / "pool.yaml"
    yaml_file.write_text("engine: {}\n")  # before: llama-server failed at load (gguf_init_from_reader: failed to read magic)
    assert llama_server.check(cfg(model_path=str(yaml_file))) == \
        [f"engine.models.{name}.model_path: {yaml_file} is not a GGUF file (it does not start with the GGUF magic)"]
    assert llama_server.check(cfg(model_path=str(tiny_gguf), llama_server_mmproj_path=str(yaml_file),
                                  llama_server_draft_model_path=str(folder))) == \
        [f"engine.models.{name}.llama_server_mmproj_path: {yaml_file} is not a GGUF file (it does not start with "
         "the GGUF magic)",
         f"engine.models.{name}.llama_server_draft_model_path: {folder} is a folder; backend 'llama_server' needs "
         "a GGUF file"]


@pytest.mark.parametrize("extra, expected", [
    (["--no-such-flag"], "--no-such-flag is not an option of {exe}"),
    (["--thread", "8"], "--thread is not an option of {exe}; did you mean --threads?"),
    (["--threads=8"], "{exe} does not read --threads=<value>; give the value as the next item: --threads, <value>"),
    (["--threads", "8", "-x"], "-x is not an option of {exe}"),
    # The value may be a secret: never repeated.
    (["--api-key=sk-never-shown"], "{exe} does not read --api-key=<value>; give the value as the next item: "
                                   "--api-key, <value>"),
])
def test_extra_args_the_built_binary_does_not_know_are_config_errors(llama_server_bin: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     extra: list[str], expected: str) -> None:
    monkeypatch.setenv("LLM_POOL_CACHE_DIR", str(tmp_path))
    cfg = model(llama_server_binary=str(llama_server_bin), llama_server_extra_args=extra)
    assert llama_server.option_problems(cfg) == \
        [f"engine.models.{cfg.name}.llama_server_extra_args: " + expected.format(exe=llama_server_bin)]


def test_extra_args_the_built_binary_knows_pass_with_their_values(llama_server_bin: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_POOL_CACHE_DIR", str(tmp_path))
    # Values that look like flags (-1) belong to the option before them; one option takes two values.
    extra = ["--threads", "8", "-n", "-1", "--no-warmup", "--control-vector-layer-range", "1", "2",
             "--override-kv", "tokenizer.ggml.add_bos_token=bool:false", "-b", "512"]
    assert llama_server.option_problems(model(llama_server_binary=str(llama_server_bin),
                                              llama_server_extra_args=extra)) == []
    # A flag llm-pool gives only for a field that is set is free while the field is not.
    assert llama_server.option_problems(model(llama_server_binary=str(llama_server_bin), llama_server_n_gpu_layers=None,
                                              llama_server_extra_args=["-ngl", "-1"])) == []


# -- extra args may not give again a flag llm-pool sets: llama-server keeps the last one given ------

@pytest.mark.parametrize("fields, extra, given, field", [
    ({}, ["-c", "512"], "-c (--ctx-size)", "llama_server_n_ctx"),
    ({}, ["--ctx-size=512"], "--ctx-size", "llama_server_n_ctx"),
    ({"llama_server_n_ctx": None}, ["--no-kv-unified"], "--no-kv-unified (--kv-unified)", "llama_server_n_ctx"),
    ({}, ["-np", "8"], "-np (--parallel)", "target_inflight"),
    ({}, ["-ngl", "-1"], "-ngl (--n-gpu-layers)", "llama_server_n_gpu_layers"),
    ({}, ["-m", "/other.gguf"], "-m (--model)", "model_path"),
    ({}, ["--port", "9"], "--port", "llama_server_port"),
    ({}, ["--embedding"], "--embedding (--embeddings)", "llama_server_embeddings"),
    ({"llama_server_reranking": True, "llama_server_pooling": None}, ["--rerank"], "--rerank (--reranking)",
     "llama_server_reranking"),
])
def test_extra_args_that_repeat_a_flag_llm_pool_sets_are_errors_naming_the_field(
        llama_server_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: dict[str, object],
        extra: list[str], given: str, field: str) -> None:
    # Before: they passed, and llama-server took the last value given: the field was silently ignored.
    monkeypatch.setenv("LLM_POOL_CACHE_DIR", str(tmp_path))
    cfg = model(llama_server_binary=str(llama_server_bin), llama_server_extra_args=["--threads", "8", *extra],
                **fields)
    assert llama_server.option_problems(cfg) == [
        f"engine.models.{cfg.name}.llama_server_extra_args: {given} is set by llm-pool from {field}, and "
        f"llama-server keeps the last one given, so one of the two would be silently lost; set {field} instead"]


@pytest.mark.parametrize("extra, given", [(["--webui"], "--webui (--no-webui)"), (["--metrics"], "--metrics"),
                                          (["-a", "other"], "-a (--alias)")])
def test_extra_args_that_repeat_a_flag_llm_pool_sets_for_itself_are_errors(
        llama_server_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], given: str) -> None:
    monkeypatch.setenv("LLM_POOL_CACHE_DIR", str(tmp_path))
    cfg = model(llama_server_binary=str(llama_server_bin), llama_server_extra_args=extra)
    assert llama_server.option_problems(cfg) == [
        f"engine.models.{cfg.name}.llama_server_extra_args: {given} is set by llm-pool itself, and llama-server "
        "keeps the last one given; remove it"]


def test_every_flag_argv_gives_has_the_field_behind_it_named() -> None:
    fields = {**llama_server.FIXED_FLAGS, **{flag: key for key, flag in llama_server.FLAGS + llama_server.SWITCHES}}
    for cfg in (model(), model(llama_server_n_ctx=None, enable_thinking=True)):
        own = llama_server.argv(replace(cfg, options={**cfg.options, "llama_server_extra_args": []}), "h", 1)
        flags = {a for a in own[1:] if a.startswith("-") and not a.lstrip("-").isdigit()}
        assert sorted(flags - set(fields)) == []
    assert all(v is None or v in model_properties() for v in fields.values())   # each a field of the schema


def _gguf_declaring(path: Path, pooling: int | None) -> Path:
    """A header-only GGUF (no tensors) whose architecture declares `pooling`, or no pooling at all."""
    from gguf import GGUFWriter, PoolingType

    writer = GGUFWriter(str(path), "bert")
    writer.add_name("pooling test")
    writer.add_token_list(["<s>", "</s>", "a"])   # an array of strings before the key is read past
    if pooling is not None:
        writer.add_pooling_type(PoolingType(pooling))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("declared, flag", [(None, "mean"), (0, "mean"), (1, None), (2, None), (3, None)])
def test_embeddings_pool_by_mean_unless_the_gguf_declares_a_pooling(tmp_path: Path, declared: int | None,
                                                                     flag: str | None) -> None:
    # llama-server's `none` pooling cannot serve /v1/embeddings (400 "not OAI compatible").
    gguf = _gguf_declaring(tmp_path / "m.gguf", declared)
    argv = llama_server.argv(model(model_path=str(gguf), llama_server_pooling=None), "127.0.0.1", 18100)
    assert (argv[argv.index("--pooling") + 1] if "--pooling" in argv else None) == flag


def test_pooling_is_left_alone_when_set_or_when_embeddings_are_off(tiny_gguf: Path, tmp_path: Path) -> None:
    given = llama_server.argv(model(model_path=str(tiny_gguf), llama_server_pooling="cls"), "127.0.0.1", 18100)
    assert given[given.index("--pooling") + 1] == "cls"
    off = llama_server.argv(model(model_path=str(tiny_gguf), llama_server_pooling=None,
                                  llama_server_embeddings=False), "127.0.0.1", 18100)
    assert "--pooling" not in off and "--embeddings" not in off
    tiny = llama_server.argv(model(model_path=str(tiny_gguf), llama_server_pooling=None), "127.0.0.1", 18100)
    assert tiny[tiny.index("--pooling") + 1] == "mean"   # the tiny GGUF declares none
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:40])        # unreadable: llama-server fails its load anyway
    assert "--pooling" not in llama_server.argv(model(model_path=str(cut), llama_server_pooling=None), "h", 1)


def test_reranking_gives_its_flag_known_to_the_built_binary_and_leaves_pooling_to_it(
        llama_server_bin: Path, tmp_path: Path) -> None:
    # --reranking is --embeddings plus --pooling rank in the pinned build; a --pooling mean chosen
    # for embeddings (the GGUF here declares none) would only be overridden by it.
    gguf = _gguf_declaring(tmp_path / "m.gguf", None)
    argv = llama_server.argv(model(model_path=str(gguf), llama_server_pooling=None, llama_server_reranking=True),
                             "127.0.0.1", 18100)
    assert "--reranking" in argv and "--pooling" not in argv
    assert "--reranking" in options(_built_help(llama_server_bin))
    assert "--reranking" not in llama_server.argv(model(), "127.0.0.1", 18100)   # off unless set
    assert llama_server.LlamaServerOptions.from_config(model()).reranking is False


def test_reranking_with_a_pooling_other_than_rank_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    tiny_gguf: Path) -> None:
    exe = _help_binary(tmp_path, monkeypatch)

    def cfg(**options: object) -> ModelConfig:
        return model(**{"llama_server_binary": str(exe), "llama_server_mmproj_path": None, "model_path": str(tiny_gguf),
                        "llama_server_media_path": None, "llama_server_draft_model_path": None,
                        "llama_server_extra_args": [], "llama_server_reranking": True, **options})

    assert llama_server.check(cfg(llama_server_pooling=None)) == []
    assert llama_server.check(cfg(llama_server_pooling="rank")) == []
    assert llama_server.check(cfg(llama_server_pooling="mean")) == [
        f"engine.models.{model().name}.llama_server_pooling: 'mean' cannot serve llama_server_reranking, which "
        "pools by rank; leave it unset or set it to rank"]


def test_its_replicas_are_asked_to_close_after_a_stream() -> None:
    # The pinned llama-server closes after every streamed answer although it offers keep-alive.
    assert llama_server.launch(model(), 0, 18100, 15, ENVIRON).closes_after_streams
