"""`mindspeed serve`: an OpenAI-compatible HTTP server for a local model.

    mindspeed serve --model DIR [--host 127.0.0.1] [--port 8000]
    torchrun --nproc-per-node 2 -m mindspeed_core.cli serve --model DIR --tp 2
    mindspeed serve      # the embedded demo: serves a small random model on a free loopback
                         # port, talks to it with 1 and 16 concurrent clients, prints a table

Endpoints: `POST /v1/chat/completions` (the model's chat template), `POST /v1/completions`,
`GET /v1/models`, `GET /health` (rows running, requests waiting). Supported request fields:
`messages` / `prompt`, `max_tokens` (or `max_completion_tokens`), `temperature`, `top_p`,
`n`, `stop`, `seed`, `stream` (server-sent events, `stream_options.include_usage`),
`logprobs` and `top_logprobs` (log-probabilities of the model's own distribution, before
temperature and top-p). Others are accepted and ignored, as OpenAI-compatible servers do.

Requests are batched continuously (`mindspeed_llm.generation.batching.DecodeBatch`): a new
request joins the running decode batch at the next step, a finished row leaves it. At most
`--max-batch` rows decode together; up to `--max-queue` requests wait beyond them, and the
next one gets HTTP 429. A body over `--max-request-bytes` gets 413, a malformed one 400 with
an OpenAI-style JSON error naming the field. SIGTERM stops accepting, lets the requests in
flight finish, and exits 0. The server listens on loopback unless `--host` says otherwise.

Needs `pip install 'mindspeed-tools[serve]'` (Starlette and uvicorn).
"""

from mindspeed_tools.serve.cli import command, demo, main

__all__ = ["command", "demo", "main"]
