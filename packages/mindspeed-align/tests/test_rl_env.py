"""Multi-turn, tool-using episodes (`mindspeed_align.rl.env`): a scripted policy (fixed
replies) through the calculator environment gives the exact tokens, masks and rewards
written here; tool tokens are unlabelled in the packed batch; an environment that raises,
an episode past its budgets and a tool call that is not JSON are each counted or answered,
never fatal; bad environment records are one line, exit 2; the calculator demo's held-out
success rises through tool calls (slow)."""

from __future__ import annotations

import json

import pytest

from mindspeed_align.rl.calculator import TEMPLATE, CalculatorEnv, calculate, ensure_calculator_demo
from mindspeed_align.rl.calculator import tool_call_text as call
from mindspeed_align.rl.env import observation_ids, parse_tool_calls, run_episodes
from mindspeed_align.rl.grpo import _per_sample
from mindspeed_align.rl.objective import pack_samples
from mindspeed_align.rl.rollout import RolloutBatch, SamplingConfig
from mindspeed_llm.chat_template import ChatTemplate, encode_text
from mindspeed_llm.data.collate import IGNORE_INDEX
from mindspeed_llm.data.sft_templates import named_template
from mindspeed_llm.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def calc_demo(tmp_path_factory):
    """Built before any function-scoped fixture (capsys breaks sentencepiece's trainer)."""
    return ensure_calculator_demo(tmp_path_factory.mktemp("calc"))


@pytest.fixture(scope="module")
def calc(calc_demo):
    return load_tokenizer(calc_demo.tokenizer), ChatTemplate(TEMPLATE, {"eos_token": "</s>"})


class ScriptedRollout:
    """A `LocalRollout` stand-in: episode e's k-th reply is script[e][k] (encoded, then the
    stop token); each later context is matched to its episode by the tokens sent so far."""

    def __init__(self, tok, script):
        self.tok, self.script = tok, script
        self.sent: dict[int, list[int]] = {}
        self.calls: list[int] = []

    def generate(self, prompts, cfg, *, seed):
        if not self.sent:
            contexts = [list(p) for p in prompts for _ in range(cfg.n)]
            episodes = list(range(len(contexts)))
        else:
            contexts = [list(p) for p in prompts]
            episodes = [next(e for e, head in self.sent.items() if c[: len(head)] == head)
                        for c in contexts]  # fmt: skip
        replies = []
        for e, context in zip(episodes, contexts, strict=True):
            turn = sum(1 for t in context if t == self.tok.eod_id)
            ids = encode_text(self.tok, self.script[e][turn]) + [self.tok.eod_id]
            self.sent[e] = context + ids
            replies.append(ids)
        self.calls.append(len(contexts))
        return RolloutBatch(contexts, replies, [[-0.5] * len(r) for r in replies],
                            list(range(len(contexts))), [True] * len(replies))  # fmt: skip


def _episodes(calc, script, records, *, n=1, env=CalculatorEnv, max_turns=4, max_tokens=200):
    tok, template = calc
    prompts = [encode_text(tok, template.render(env().reset(r), add_generation_prompt=True))
               for r in records]  # fmt: skip
    cfg = SamplingConfig(n=n, max_new_tokens=40, stop_token_ids=(tok.eod_id,))
    rollout = ScriptedRollout(tok, script)
    out = run_episodes(rollout, env, records, prompts, cfg, template=template, tokenizer=tok,
                       seed=0, max_turns=max_turns, max_tokens=max_tokens)  # fmt: skip
    return out, rollout


def test_scripted_episodes_give_the_exact_tokens_masks_and_rewards(calc):
    tok, _ = calc
    records = [{"question": "what is 12 times 34?", "answer": 408},
               {"question": "what is 56 times 78?", "answer": 4368}]  # fmt: skip
    script = [
        [call("12 * 34"), "the answer is 408"],  # the tool, then its result: right
        ["the answer is 400"],  # directly, wrong
        [call("56 * 78"), "the answer is 4368"],
        [call("56 * 77"), "the answer is 4312"],  # the wrong call, its result copied: wrong
    ]
    out, rollout = _episodes(calc, script, records, n=2)
    eod = tok.eod_id

    def ids(text):
        return encode_text(tok, text)

    tool_turn = ids(" result: 408 answer: ")
    first = ids(call("12 * 34")) + [eod]
    final = ids("the answer is 408") + [eod]
    assert out.batch.response_ids[0] == first + tool_turn + final
    assert out.batch.response_mask[0] == [1] * len(first) + [0] * len(tool_turn) + [1] * len(final)
    assert out.batch.response_ids[1] == ids("the answer is 400") + [eod]
    assert out.batch.response_mask[1] == [1] * len(out.batch.response_ids[1])
    assert out.batch.response_ids[3][len(ids(call("56 * 77"))) + 1 :][: len(ids(" result: 4312 answer: "))] \
        == ids(" result: 4312 answer: ")  # fmt: skip
    assert out.rewards == [1.0, 0.0, 1.0, 0.0]
    assert out.batch.group == [0, 0, 1, 1]
    assert out.batch.prompt_ids[0] == out.batch.prompt_ids[1] != out.batch.prompt_ids[2]
    # the sampler's log-probs on the policy's tokens, 0 on the tool's
    assert out.batch.sampler_logprobs[0] == [-0.5] * len(first) + [0.0] * len(tool_turn) + [-0.5] * len(final)
    assert rollout.calls == [4, 3]  # turn two continues the three episodes that called
    assert out.metrics == {"env/turns": 1.75, "env/tool_calls": 0.75, "env/done_fraction": 1.0,
                           "env/errors": 0.0, "env/over_budget": 0.0}  # fmt: skip


def test_tool_tokens_are_not_trained(calc):
    """Packed, the tool's tokens carry no label and no weight; a sample's length in the
    aggregation is its policy tokens; per-token values survive a repack (epochs) with 0 on
    the tool's tokens."""
    records = [{"question": "what is 12 times 34?", "answer": 408}]
    out, _ = _episodes(calc, [[call("12 * 34"), "the answer is 408"]], records)
    b = out.batch
    mask, response = b.response_mask[0], b.response_ids[0]
    values = [[float(i + 1) for i in range(len(response))]]
    packed = pack_samples(b.prompt_ids, b.response_ids, {}, {"old_logps": values},
                          agg="seq-mean-token-mean", max_new_tokens=40, pad_multiple=1,
                          masks=b.response_mask)  # fmt: skip
    start = len(b.prompt_ids[0]) - 1
    labels = packed["labels"][0, start : start + len(response)].tolist()
    assert labels == [t if m else IGNORE_INDEX for t, m in zip(response, mask, strict=True)]
    weights = packed["weights"][0, start : start + len(response)].tolist()
    assert weights == pytest.approx([m / sum(mask) for m in mask])
    assert packed["unit"][0].sum().item() == 1.0 and packed["unit"][0, start].item() == 1.0
    fixed = _per_sample([packed], [[0]], b)
    assert fixed["old_logps"][0] == [v if m else 0.0 for v, m in zip(values[0], mask, strict=True)]


def test_an_environment_that_raises_or_loops_is_counted_and_scored_zero(calc):
    class Flaky(CalculatorEnv):
        def step(self, messages, reply):
            if "13" in messages[0]["content"]:
                raise RuntimeError("tool server down")
            if "14" in messages[0]["content"]:
                return {"role": "tool", "content": "not a list"}, 0.0, False
            return super().step(messages, reply)

    records = [{"question": "what is 12 times 34?", "answer": 408},
               {"question": "what is 13 times 10?", "answer": 130},
               {"question": "what is 14 times 10?", "answer": 140},
               {"question": "what is 20 times 30?", "answer": 600}]  # fmt: skip
    script = [[call("12 * 34")] * 5, ["the answer is 130"], ["the answer is 140"],
              [call("20 * 30"), "the answer is 600"]]  # fmt: skip
    out, _ = _episodes(calc, script, records, env=Flaky, max_turns=3)
    # past 3 turns; raised; answered with no message list; the run went on
    assert out.rewards == [0.0, 0.0, 0.0, 1.0]
    assert out.metrics["env/errors"] == 2.0 and out.metrics["env/over_budget"] == 1.0
    assert sum(out.batch.response_mask[0]) == 3 * (len(encode_text(calc[0], call("12 * 34"))) + 1)
    # the token budget: the first reply's tool turn does not fit in 30 tokens
    out, _ = _episodes(calc, [[call("12 * 34"), "the answer is 408"]], records[:1], max_tokens=30)
    assert out.rewards == [0.0] and out.metrics["env/over_budget"] == 1.0


def test_a_tool_call_that_is_not_json_gets_an_observation_saying_so(calc):
    tok, _ = calc
    assert parse_tool_calls('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": '
                            '\\"2 * 3\\"}"}</tool_call>')[0].arguments == {"expression": "2 * 3"}  # fmt: skip
    assert parse_tool_calls("no call") == []
    assert "not valid JSON" in parse_tool_calls("<tool_call>{name: 1}</tool_call>")[0].error
    assert calculate("12 * (3 + 4) - 5") == "79"
    assert calculate("2 ** 99").startswith("error:") and calculate("open('x')").startswith("error:")
    records = [{"question": "what is 12 times 34?", "answer": 408}]
    out, _ = _episodes(calc, [["<tool_call>{calculator 12*34}</tool_call>", "the answer is 408"]], records)
    mask, response = out.batch.response_mask[0], out.batch.response_ids[0]
    observation = tok.decode([t for t, m in zip(response, mask, strict=True) if not m])
    assert "result: error: the tool call is not valid JSON" in observation
    assert out.rewards == [1.0]


def test_observations_follow_a_hermes_template():
    """Qwen's template (the Hermes `<tool_call>` format's home): the tokens after a reply
    that stopped on <|im_end|> are the tool turn and the next generation prompt."""

    class Chars:  # a tokenizer of characters, with <|im_end|> one special token
        special_tokens = {"<|im_end|>": 1000}

        def encode(self, text):
            return [ord(c) for c in text]

    template = named_template("qwen")
    history = [{"role": "user", "content": "what is 12 times 34?"}]
    ids = observation_ids(template, Chars(), history, call("12 * 34"),
                          [{"role": "tool", "content": "408"}], stop_text="<|im_end|>")  # fmt: skip
    text = "".join("<|im_end|>" if i == 1000 else chr(i) for i in ids)
    assert text == ("\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")  # fmt: skip


@pytest.mark.parametrize(
    ("args", "record", "expected"),
    [
        (["--grpo.env", "calculator"], {"answer": 6},
         "env.jsonl: record 1: grpo.env reset failed: KeyError('question')"),
        (["--grpo.env", "calculator"], {"question": "what is 2 times 3?", "answer": 6},
         "grpo.env_max_tokens=96 leaves no room for a prompt in data.seq_len=64"),
        (["--env", "nowhere:Env"], {"question": "q", "answer": 1}, "grpo.env='nowhere:Env': cannot import"),
        (["--ppo.env", "calculator"], {"question": "q", "answer": 1}, "ppo.env: multi-turn episodes"),
        (["--ppo.async_rollout", "one_step"], {"question": "q", "answer": 1}, "ppo.async_rollout: one-step"),
        (["--grpo.async_rollout", "sometimes"], {"question": "q", "answer": 1}, "grpo.async_rollout"),
        (["--grpo.shared_prompts", "sometimes"], {"question": "q", "answer": 1}, "grpo.shared_prompts"),
        (["--grpo.trainer_actors", "2"], {"question": "q", "answer": 1},
         "grpo.trainer_actors=2: a count >= 0, above 0 only with grpo.placement=ray"),
        (["--grpo.env", "calculator", "--grpo.env_max_turns", "0"], {"question": "q", "answer": 1},
         "grpo.env_max_turns=0 and grpo.env_max_tokens=96 must be positive"),
    ],
)  # fmt: skip
def test_bad_environment_input_is_one_line(calc_demo, tmp_path, capsys, args, record, expected):
    from mindspeed_align.rl.cli import main, ppo_main
    from mindspeed_core.cli import guarded

    path = tmp_path / "env.jsonl"
    good = {"question": "what is 2 times 3?", "answer": 6}
    path.write_text("".join(json.dumps(r) + "\n" for r in [good, record, good]))
    common = ["--data.prompts", str(path), "--data.tokenizer", str(calc_demo.tokenizer),
              "--data.chat_template", str(calc_demo.template), "--data.eval_prompts", "1",
              "--logging.run_dir", str(tmp_path / "run")]  # fmt: skip
    if "seq_len" not in expected:
        common += ["--data.seq_len", "128"]
    run = ppo_main if args[0].startswith("--ppo") else main
    assert guarded(run, [*args, *common]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_reset_conversation_without_a_user_turn_is_refused(calc):
    from mindspeed_align.rl.cli import _env_prompts
    from mindspeed_align.rl.config import GRPOConfig
    from mindspeed_core.errors import DataError

    class SystemOnly(CalculatorEnv):
        def reset(self, record):
            return [{"role": "system", "content": record["question"]}]

    records = [{"question": "what is 2 times 3?", "answer": 6}]
    with pytest.raises(DataError, match="prompts.jsonl: record 0: the messages have no user turn"):
        _env_prompts(GRPOConfig(), SystemOnly, calc[1], records, "prompts.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("async_rollout", ["off", "one_step"])
def test_calculator_demo_learns_to_call_the_tool(tmp_path, async_rollout):
    """`mindspeed grpo --env calculator` (about a minute): greedy, the SFT'd model answers
    directly and is mostly wrong; after GRPO it calls the tool and is right; and so with
    one-step off-policy rollouts."""
    from mindspeed_align.rl.cli import _demo_defaults, grpo
    from mindspeed_align.rl.config import GRPOConfig, GRPOLoggingSection, GRPOSection
    from mindspeed_core.training import read_metrics

    cfg = GRPOConfig(grpo=GRPOSection(env="calculator", async_rollout=async_rollout),
                     logging=GRPOLoggingSection(run_dir=tmp_path / "grpo", progress=False))  # fmt: skip
    _demo_defaults(cfg, "grpo")
    summary = grpo(cfg)
    assert summary["reward_before"] < 0.3 and summary["tool_calls_before"] < 0.2, summary
    assert summary["reward_after"] > 0.8 and summary["tool_calls_after"] > 0.9, summary
    staleness = {m.get("rollout/staleness") for m in read_metrics(tmp_path / "grpo" / "metrics.jsonl")}
    assert staleness == ({1.0} if async_rollout == "one_step" else {None})


def test_an_environments_tools_reach_the_template_as_transformers_passes_them():
    """Qwen2.5's published template with the calculator's `tools`: the prompt, and the
    conversation after a tool call and its result, render as transformers renders them with
    `tools=` (character for character), and the observation is what lies between."""
    from pathlib import Path

    from transformers.utils.chat_template_utils import render_jinja_template

    from mindspeed_align.rl.data import render_prompts

    source = (Path(__file__).parents[2] / "mindspeed-llm" / "tests" / "fixtures" / "chat_templates"
              / "qwen.jinja").read_text()  # fmt: skip
    template = ChatTemplate(source, {"eos_token": "<|im_end|>"})
    tools = CalculatorEnv.tools

    def hf(chat):
        rendered, _ = render_jinja_template(conversations=[chat], chat_template=source, tools=tools,
                                            add_generation_prompt=True, eos_token="<|im_end|>")  # fmt: skip
        return rendered[0]

    env = CalculatorEnv()
    records = [{"question": "what is 12 times 34?", "answer": 408}]
    records[0]["messages"] = env.reset(records[0])
    render_prompts(records, template, source="x", tools=tools)
    assert records[0]["prompt"] == hf(records[0]["messages"])
    assert '"name": "calculator"' in records[0]["prompt"]  # the schema reached the system turn

    class Chars:
        special_tokens = {"<|im_end|>": 1000}

        def encode(self, text):
            return [ord(c) for c in text]

    reply, result = call("12 * 34"), [{"role": "tool", "content": "408"}]
    ids = observation_ids(template, Chars(), records[0]["messages"], reply, result,
                          stop_text="<|im_end|>", tools=tools)  # fmt: skip
    whole = hf([*records[0]["messages"], {"role": "assistant", "content": reply}, *result])
    head = records[0]["prompt"] + reply + "<|im_end|>"
    assert whole.startswith(head)
    assert "".join("<|im_end|>" if i == 1000 else chr(i) for i in ids) == whole[len(head):]
