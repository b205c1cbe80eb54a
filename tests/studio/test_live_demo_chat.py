"""`make run`'s studio answers chat with the real model: set up as `make run` does (`migrate`,
`setup_demo`, daphne serving `studio.asgi` in a subprocess; embedded: SQLite in its own data
directory, no Redis), the `openai` client asks the model `chat` (the demo user's `workflows/chat.py`,
`smollm2-135m`) with the token `setup_demo` printed, streaming and not. The references are the
checkpoint's own tokenizer (`apply_chat_template`, token counts) and Hugging Face `generate` on the
same checkpoint (the greedy answer); the Python `setup_demo` printed runs as pasted. Then the server
stops and `make run` runs again: `setup_demo` keeps the deployment and issues a new token, and the
new server answers too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.compute.models.cache import ModelCache
from engine.compute.models.packaged import PACKAGED_MODELS
from studio.workflows.management.commands.setup_demo import CHAT_SNIPPET_HEAD
from tests.liveserver import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
NEW = 24
# What `make run` has no use for: the suite's shared services and settings.
_DROPPED = ("DATABASE_URL", "REDIS_URL", "OMNIFLOW_DISPATCH", "OMNIFLOW_SECRET_KEY", "OMNIFLOW_DATA_DIR",
            "DJANGO_SETTINGS_MODULE")


def make_run_env(data_dir: Path, cache: ModelCache) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
    env.update(OMNIFLOW_DATA_DIR=str(data_dir), OMNIFLOW_CACHE_DIR=str(cache.config.root), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT))
    return env


@dataclass(frozen=True, slots=True)
class Printed:
    """What `setup_demo` printed for chat: the token, and the Python to paste."""

    token: str
    snippet: str


def setup(env: dict[str, str], url: str, *, migrate: bool = True) -> Printed:
    """`make run`'s set-up steps for a studio served at `url`; what `setup_demo` printed for chat."""
    manage = [sys.executable, str(ROOT / "manage.py")]
    if migrate:
        subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True, timeout=300)
    out = subprocess.run([*manage, "setup_demo", "--url", url], cwd=ROOT, env=env, check=True, timeout=300,
                         capture_output=True, text=True).stdout
    match = re.search(r"^chat token: (\S+)$", out, re.MULTILINE)
    assert match and 'model="chat"' in out and f'api_key="{match[1]}"' in out, out
    return Printed(match[1], out.split(CHAT_SNIPPET_HEAD + "\n", 1)[1])


@contextmanager
def server(env: dict[str, str], log: Path, port: int) -> Iterator[str]:
    """daphne as `make run` starts it, on `port`; its role workers exit with it."""
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                                 "studio.asgi:application"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}/healthz")
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def reference(directory: Path) -> tuple[AutoTokenizer, list[int]]:
    """The checkpoint's tokenizer and Hugging Face's greedy answer ids (EOS included, as generated)."""
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True,
                                                      return_dict=True)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return tokenizer, out[0, ids.shape[1]:].tolist()


@pytest.mark.timeout(900)
def test_make_run_answers_the_openai_client_with_the_real_model_and_again_after_a_restart(
        smollm2_cache: ModelCache, tmp_path: Path) -> None:
    env = make_run_env(tmp_path / "data", smollm2_cache)
    port = free_port()  # `make run`'s STUDIO_PORT: the printed snippet names it
    printed = setup(env, f"http://127.0.0.1:{port}")
    token = printed.token
    log = tmp_path / "server.log"
    with server(env, log, port) as base:
        # The reference, computed while the server deploys the model (it does as it starts).
        tokenizer, expected = reference(smollm2_cache.directory(PACKAGED_MODELS["smollm2-135m"]))
        prompt_tokens = len(tokenizer.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True,
                                                          return_dict=True)["input_ids"])
        ended = expected[-1] == tokenizer.eos_token_id
        answer = tokenizer.decode(expected, skip_special_tokens=True)
        assert "Paris" in answer  # the reference itself is a real answer
        client = openai.OpenAI(base_url=base + "/v1", api_key=token, max_retries=0, timeout=600)
        (listed,) = client.models.list().data
        assert (listed.id, listed.owned_by, listed.workflow, listed.weights) == ("chat", "demo", "chat", "real")
        # The first request may find the model starting (the server deploys it as it starts): it waits.
        done = client.chat.completions.create(model="chat", messages=QUESTION, max_tokens=NEW, temperature=0)
        text = done.choices[0].message.content
        assert text == answer, server_log(log)
        assert done.usage.prompt_tokens == prompt_tokens  # the model's own chat template, its tokenizer
        assert done.usage.completion_tokens == len(expected)
        assert done.usage.completion_tokens == len(tokenizer(text).input_ids) + ended  # EOS is a token it generated
        assert done.choices[0].finish_reason == ("stop" if ended else "length")

        chunks = list(client.chat.completions.create(model="chat", messages=QUESTION, max_tokens=NEW, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(deltas) > 1 and "".join(deltas) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == done.choices[0].finish_reason
        assert chunks[-1].usage.prompt_tokens == prompt_tokens
        assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens

        # The Python `setup_demo` printed, run as pasted: it asks the model and prints its reply.
        pasted = subprocess.run([sys.executable, "-"], input=printed.snippet, env=env, capture_output=True, text=True,
                                timeout=600)
        assert pasted.returncode == 0 and pasted.stdout.strip(), (pasted.stdout, pasted.stderr, server_log(log))

    # `make run` again (its `migrate` has nothing left to do): the same deployment, a new token; the new
    # server deploys it as it starts.
    again = setup(env, f"http://127.0.0.1:{port}", migrate=False).token
    assert again != token
    with server(env, log, port) as base:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key=token, max_retries=0).models.list()
        client = openai.OpenAI(base_url=base + "/v1", api_key=again, max_retries=0, timeout=600)
        assert [m.id for m in client.models.list().data] == ["chat"]
        done = client.chat.completions.create(model="chat", messages=QUESTION, max_tokens=NEW, temperature=0)
        assert done.choices[0].message.content == answer, server_log(log)


def server_log(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]
