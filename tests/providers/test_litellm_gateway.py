"""A real gateway in the test path: LiteLLM's proxy between Sidequest and the scripted model server.

Gateways re-wrap the upstream's errors in their own envelope and status ("litellm.ContextWindowExceededError:
…", type ``throttling_error``, the upstream's ``Retry-After`` renamed ``llm_provider-retry-after``), so
what the classifier sees through one differs from what the backend sent. These tests start the proxy
(``litellm[proxy]``, the ``gateway`` extra) on a free loopback port with a config that routes
``scripted-model`` to the scripted server as an OpenAI-compatible backend, and prove through it:

- an overflow from the backend is a :class:`ContextOverflow` with the prompt's real token count, and the
  pipeline's one overflow retry happens;
- a 429 is waited for and retried (the wait read from the gateway's renamed header);
- an unknown model (the proxy's own 400, and the backend's 404 passed through) is ``model_unavailable``.

Marked ``gateway`` and left out of the default run; ``scripts/test-gateway`` installs the proxy into its
own ``.venv-gateway`` and runs them (docs/providers.md). The proxy is kept offline: the bundled model cost
map (``LITELLM_LOCAL_MODEL_COST_MAP``), no telemetry, no database, no cooldowns or retries of its own (so
every retry seen is Sidequest's).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from service.config import Settings
from service.providers import build_provider
from service.providers.base import ContextOverflow, ModelUnavailable, Provider, RateLimited
from service.providers.calling import run_call
from service.providers.openai_compat import OpenAIProvider
from service.store.db import Database
from tests.factories import add_history, admit, make_session, scripted_settings
from tests.net import free_port
from tests.pipeline.conftest import run_one
from tests.providers.helpers import ListRecorder, collect, make_call
from tests.scripted_provider import ScriptedServer, Step, Usage

pytestmark = pytest.mark.gateway

READY_WITHIN_S = 180.0  # the proxy imports a lot; this machine is shared
ROOT = Path(__file__).resolve().parents[2]

VLLM_OVERFLOW = {
    "object": "error",
    "message": "This model's maximum context length is 4096 tokens. However, your request has 5120 input "
    "tokens. Please reduce the length of the input messages.",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}


def litellm_executable() -> str:
    """The ``litellm`` CLI: $SIDEQUEST_LITELLM, else ./.venv-gateway, else next to this interpreter / PATH."""
    candidates = [
        os.environ.get("SIDEQUEST_LITELLM"),
        str(ROOT / ".venv-gateway" / "bin" / "litellm"),
        str(Path(sys.executable).with_name("litellm")),
        shutil.which("litellm"),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail(
        "LiteLLM's proxy is not installed: run scripts/test-gateway (it installs the `gateway` extra into "
        ".venv-gateway), or set SIDEQUEST_LITELLM to a `litellm` executable"
    )


@dataclass(frozen=True)
class Gateway:
    base_url: str  # with /v1, as SIDEQUEST_BASE_URL wants it
    key: str  # the proxy's master key: what Sidequest sends as its API key
    log: Path


def _config(backend: ScriptedServer) -> str:
    return f"""
model_list:
  - model_name: scripted-model
    litellm_params:
      model: openai/scripted-model
      api_base: {backend.base_url}
      api_key: sk-scripted-backend
litellm_settings:
  num_retries: 0
  request_timeout: 30
  telemetry: false
router_settings:
  num_retries: 0
  disable_cooldowns: true
general_settings:
  disable_spend_logs: true
  forward_client_headers_to_llm_api: true
"""


@pytest.fixture(scope="module")
def backend() -> Iterator[ScriptedServer]:
    with ScriptedServer() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(backend: ScriptedServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    executable = litellm_executable()
    work = tmp_path_factory.mktemp("litellm")
    config = work / "config.yaml"
    config.write_text(_config(backend), encoding="utf-8")
    log = work / "proxy.log"
    key = "sk-" + secrets.token_hex(16)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIDEQUEST_", "OPENAI_", "LITELLM_"))}
    env.update(
        LITELLM_MASTER_KEY=key,
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        LITELLM_TELEMETRY="False",
        NO_DOCS="True",
    )
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [executable, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            cwd=work,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        root = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the LiteLLM proxy exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(root + "/health/liveliness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > READY_WITHIN_S:
                tail = log.read_text()[-4000:]
                pytest.fail(f"the LiteLLM proxy was not ready within {READY_WITHIN_S:.0f}s:\n{tail}")
            time.sleep(0.5)
        yield Gateway(base_url=root + "/v1", key=key, log=log)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def scripted(backend: ScriptedServer) -> ScriptedServer:
    backend.reset()
    return backend


@pytest.fixture
async def through_gateway(gateway: Gateway) -> AsyncIterator[OpenAIProvider]:
    provider = OpenAIProvider(gateway.base_url, gateway.key, "scripted-model")
    try:
        yield provider
    finally:
        await provider.aclose()


@pytest.fixture
def gateway_settings(database_url: str, gateway: Gateway) -> Settings:
    return scripted_settings(database_url, gateway.base_url, api_key=gateway.key)


@pytest.fixture
async def pipeline_provider(gateway_settings: Settings) -> AsyncIterator[Provider]:
    built = build_provider(gateway_settings)
    try:
        yield built
    finally:
        await built.aclose()


# ---- the adapter through the gateway --------------------------------------------------------------


async def test_an_overflow_from_the_backend_arrives_as_an_overflow_with_its_counts(
    scripted: ScriptedServer, through_gateway: OpenAIProvider
) -> None:
    scripted.script("answer", Step.overflow(VLLM_OVERFLOW))
    with pytest.raises(ContextOverflow) as caught:
        await collect(through_gateway, make_call())
    error = caught.value
    assert "ContextWindowExceededError" in error.message  # it really went through LiteLLM's mapping
    assert error.status == 400
    assert (error.prompt_tokens, error.context_limit) == (5120, 4096)
    # The proxy passed Sidequest's headers on to the backend.
    assert scripted.requests("answer")[0].purpose == "answer"


async def test_an_overflow_inside_the_stream_arrives_as_an_overflow(
    scripted: ScriptedServer, through_gateway: OpenAIProvider
) -> None:
    scripted.script("answer", Step.overflow_in_stream({"error": VLLM_OVERFLOW}))
    with pytest.raises(ContextOverflow) as caught:
        await collect(through_gateway, make_call())
    # HTTP 200 with the error as an SSE chunk: the status is the one the chunk's own code names.
    assert caught.value.status == 400
    assert (caught.value.prompt_tokens, caught.value.context_limit) == (5120, 4096)


async def test_a_rate_limit_through_the_gateway_is_retried_after_the_backends_wait(
    scripted: ScriptedServer, through_gateway: OpenAIProvider
) -> None:
    scripted.script(
        "answer", Step.rate_limited(retry_after="0.2"), Step.text("After the wait.", usage=Usage(12, 4))
    )
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    recorder = ListRecorder()
    result = await run_call(
        through_gateway, make_call(), recorder=recorder, deadline=time.monotonic() + 60, sleep=sleep
    )
    assert result.text == "After the wait."
    # The backend's Retry-After reached us renamed (llm_provider-retry-after) and was honoured.
    assert waits == [pytest.approx(0.2)]
    assert [c.status for c in recorder.calls] == ["failed", "ok"]
    assert len(scripted.requests("answer")) == 2


async def test_an_exhausted_quota_through_the_gateway_is_not_retried(
    scripted: ScriptedServer, through_gateway: OpenAIProvider
) -> None:
    scripted.script("answer", Step.quota_exhausted(), Step.text("never"))
    with pytest.raises(RateLimited) as caught:
        await run_call(through_gateway, make_call(), recorder=ListRecorder(), deadline=time.monotonic() + 60)
    # LiteLLM drops the insufficient_quota code; the wording still says the quota is gone.
    assert caught.value.quota_exhausted is True and caught.value.attempts == 1
    assert len(scripted.requests("answer")) == 1


async def test_a_model_the_gateway_does_not_route_is_model_unavailable(
    scripted: ScriptedServer, through_gateway: OpenAIProvider
) -> None:
    with pytest.raises(ModelUnavailable) as caught:
        await collect(through_gateway, make_call(model="no-such-model"))
    assert caught.value.status == 400  # the proxy's own "Invalid model name passed in model=…"
    assert scripted.requests("answer") == []


async def test_a_model_the_backend_does_not_have_is_model_unavailable(
    scripted: ScriptedServer, through_gateway: OpenAIProvider
) -> None:
    scripted.script("answer", Step.model_not_found("scripted-model"))
    with pytest.raises(ModelUnavailable) as caught:
        await collect(through_gateway, make_call())
    assert caught.value.status == 404


# ---- the whole pipeline through the gateway ---------------------------------------------------------


async def test_the_pipeline_retries_an_overflow_once_through_the_gateway(
    db: Database, gateway_settings: Settings, pipeline_provider: Provider, scripted: ScriptedServer
) -> None:
    sid = await make_session(db, "gateway-overflow")
    await add_history(db, sid, [(f"q{i}", f"a{i} " * 50) for i in range(1, 6)])
    rid = await admit(db, sid, "q")
    scripted.script("answer", Step.overflow(VLLM_OVERFLOW), Step.text("Fits now.", usage=Usage(100, 3)))

    ran = await run_one(db, gateway_settings, pipeline_provider, rid)

    assert ran.outcome.status == "succeeded" and ran.row.answer == "Fits now."
    assert ran.row.context_info["overflow_retries"] == 1
    answers = scripted.requests("answer")
    assert len(answers) == 2
    assert len(str(answers[1].body["messages"])) < len(str(answers[0].body["messages"]))
    assert [c["status"] for c in ran.row.usage["calls"] if c["purpose"] == "answer"] == ["failed", "ok"]


async def test_the_pipeline_waits_out_a_rate_limit_through_the_gateway(
    db: Database, gateway_settings: Settings, pipeline_provider: Provider, scripted: ScriptedServer
) -> None:
    sid = await make_session(db, "gateway-rate-limit")
    rid = await admit(db, sid, "q")
    scripted.script("answer", Step.rate_limited(retry_after="0.2"), Step.text("After the wait."))

    ran = await run_one(db, gateway_settings, pipeline_provider, rid)

    assert ran.outcome.status == "succeeded" and ran.row.answer == "After the wait."
    assert len(scripted.requests("answer")) == 2


async def test_the_pipeline_reports_model_unavailable_through_the_gateway(
    db: Database, database_url: str, gateway: Gateway, scripted: ScriptedServer
) -> None:
    settings = scripted_settings(database_url, gateway.base_url, api_key=gateway.key, model="no-such-model")
    provider = build_provider(settings)
    try:
        sid = await make_session(db, "gateway-model")
        rid = await admit(db, sid, "q")
        ran = await run_one(db, settings, provider, rid)
    finally:
        await provider.aclose()
    assert ran.row.error is not None and ran.row.error["code"] == "model_unavailable"
    assert scripted.requests("answer") == []
