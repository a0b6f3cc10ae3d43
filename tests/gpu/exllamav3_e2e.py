"""ExLlamaV3 end to end on an NVIDIA GPU: a tiny EXL3 model made by exllamav3's own converter, served
by the shim under `llm-pool serve`, exercised through the proxy. Not part of `pytest` (no CUDA in CI).

    pip install -e '.[test,exllamav3]'     # exllamav3 1.6.5 with a CUDA torch
    python tests/gpu/exllamav3_e2e.py [--keep DIR]

1. writes a random-weight Llama in Hugging Face layout (safetensors, config, tokenizer.json),
2. quantizes it to EXL3 at 4 bits with exllamav3.conversion.convert_model (as its convert.py does),
3. starts the proxy with the seed's ExLlamaV3 example pointed at it, then checks: load, both APIs,
   streaming, requests batched together (target_inflight 4), a client that leaves is cancelled in
   the generator, unload ends the process. Exits non-zero on the first failure.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from helpers import ProxyProcess, http, pid_alive, wait_for  # noqa: E402

HIDDEN, FFN, LAYERS, HEADS, VOCAB = 256, 768, 2, 4, 512


def write_random_llama(out: Path) -> Path:
    """A random-weight LlamaForCausalLM in fp16 safetensors, with the tiny CT2 model's tokenizer."""
    import torch
    from safetensors.torch import save_file

    from proxy.setup.tiny_ct2 import _tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "head_dim": HIDDEN // HEADS, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float16"}))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).half()

    tensors = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": torch.ones(HIDDEN).half(),
               "lm_head.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = w(HIDDEN, HIDDEN)
        tensors[p + "mlp.gate_proj.weight"] = w(FFN, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = w(FFN, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = w(HIDDEN, FFN)
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN).half()
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN).half()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def convert_to_exl3(src: Path, out: Path, work: Path) -> Path:
    from exllamav3.conversion.convert_model import main as convert
    from exllamav3.conversion.convert_model import parser, prepare

    args = parser.parse_args(["-i", str(src), "-o", str(out), "-w", str(work), "-b", "4.0", "-cr", "8", "-cc", "256"])
    in_args, job_state, ok, err = prepare(args)
    if not ok:
        raise SystemExit(f"convert: {err}")
    convert(in_args, job_state)
    return out


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing")


def check(cond: bool, what: str) -> None:
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        raise SystemExit(1)


def serve_and_check(model_dir: Path) -> None:
    seed = {"backend": "exllamav3", "model_path": str(model_dir), "prompt_format": "generic",
            "exllama_cache_size": 8192, "exllama_cache_quant": None, "target_inflight": 4, "enabled": True}
    proxy = ProxyProcess({"exl3": seed}, service={"log_level": "info"})
    try:
        proxy.start()
        replica = proxy.wait_state("exl3", "loaded", timeout=600)["replicas"][0]
        proxy.seen_pids.add(replica["pid"])
        check(replica["state"] == "ready", "the EXL3 model loads and its replica is ready")
        status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                               body={"model": "exl3", "messages": [{"role": "user", "content": "hello"}],
                                     "max_tokens": 16})
        check(status == 200 and body["usage"]["completion_tokens"] > 0, "chat completion")
        status, _, body = http("POST", proxy.url + "/v1/responses",
                               body={"model": "exl3", "input": "hello", "decoding": {"max_tokens": 16}})
        check(status == 200 and body["metrics"]["engine_output_tokens"] > 0, "/v1/responses")
        req = urllib.request.Request(proxy.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "exl3", "prompt": "hi", "max_tokens": 64,
                                                      "ignore_eos": True, "stream": True}).encode())
        with urllib.request.urlopen(req, timeout=120) as resp:
            events = [e for e in resp.read().decode().split("\n\n") if e]
        check(len(events) > 8 and events[-1] == "data: [DONE]", f"streamed {len(events)} events")

        port = replica["port"]
        seen_running = []
        def sample() -> None:
            for _ in range(400):
                seen_running.append(metric(port, "vllm:num_requests_running"))
        sampler = threading.Thread(target=sample)
        sampler.start()
        results = []
        def one() -> None:
            results.append(http("POST", proxy.url + "/v1/completions",
                                body={"model": "exl3", "prompt": "hi", "max_tokens": 512, "ignore_eos": True})[0])
        workers = [threading.Thread(target=one) for _ in range(4)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        sampler.join()
        check(results == [200] * 4 and max(seen_running) >= 2, f"4 requests batched (max running {max(seen_running)})")

        req = urllib.request.Request(proxy.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "exl3", "prompt": "hi", "max_tokens": 4000,
                                                      "ignore_eos": True, "stream": True}).encode())
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.readline()
        wait_for(lambda: metric(port, "llm_pool_shim:requests_cancelled_total") == 1, what="the job to be cancelled")
        check(metric(port, "vllm:num_requests_running") == 0, "a client that leaves is cancelled in the generator")

        status, _, body = http("POST", proxy.url + "/v1/admin/models/exl3/unload")
        check(status == 200 and not pid_alive(replica["pid"]), "unload ends the process")
    finally:
        proxy.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keep", help="folder for the models (default: a temporary one)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU with CUDA")
    root = Path(args.keep or tempfile.mkdtemp(prefix="lp-exl3-"))
    src = write_random_llama(root / "hf")
    model = convert_to_exl3(src, root / "exl3", root / "work")
    serve_and_check(model)
    print("all ExLlamaV3 checks passed", flush=True)


if __name__ == "__main__":
    main()
