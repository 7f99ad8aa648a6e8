"""The scripted model server itself: routing by purpose, defaults, recording, both wire formats."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import anthropic
import openai

from tests.scripted_provider import VALID_SUMMARY, ScriptedServer, Step, Usage


def post(server: ScriptedServer, purpose: str, body: dict[str, object]) -> tuple[int, bytes]:
    request = urllib.request.Request(
        server.base_url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-sidequest-purpose": purpose},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_steps_are_consumed_in_order_per_purpose_then_the_default(server: ScriptedServer) -> None:
    server.script("answer", Step.text("one"), Step.text("two"))
    server.script("qa_summary", Step.text("summary one"))

    replies = [
        json.loads(post(server, purpose, {"model": "m", "messages": []})[1])["choices"][0]["message"][
            "content"
        ]
        for purpose in ("answer", "qa_summary", "answer", "answer", "qa_summary")
    ]

    assert replies[:3] == ["one", "summary one", "two"]
    assert replies[3] == "Scripted answer."  # the answer default
    assert json.loads(replies[4]) == VALID_SUMMARY  # summaries default to a valid document
    assert server.pending("answer") == 0


def test_set_default_and_reset(server: ScriptedServer) -> None:
    server.set_default("answer", Step.http_error(418, {"error": {"message": "teapot"}}))
    assert post(server, "answer", {})[0] == 418
    server.reset()
    assert post(server, "answer", {"messages": []})[0] == 200
    assert len(server.requests()) == 1  # reset forgot the earlier request


def test_every_request_is_recorded_in_order_with_headers_and_body(server: ScriptedServer) -> None:
    post(server, "answer", {"model": "a", "messages": [{"role": "user", "content": "x"}]})
    post(server, "context_summary", {"model": "b", "messages": []})

    recorded = server.requests()
    assert [(r.method, r.path, r.purpose) for r in recorded] == [
        ("POST", "/v1/chat/completions", "answer"),
        ("POST", "/v1/chat/completions", "context_summary"),
    ]
    assert recorded[0].body["messages"] == [{"role": "user", "content": "x"}]
    assert recorded[0].at <= recorded[1].at
    assert [r.body["model"] for r in server.requests(purpose="context_summary")] == ["b"]


def test_models_endpoint_lists_the_served_models(server: ScriptedServer) -> None:
    with urllib.request.urlopen(server.base_url + "/models", timeout=5) as response:
        listed = json.loads(response.read())
    assert [m["id"] for m in listed["data"]] == ["scripted-model"]


def test_non_streaming_openai_reply_through_the_sdk(server: ScriptedServer) -> None:
    server.script(
        "answer",
        Step.text("Hello", reasoning="hmm", usage=Usage(20, 3, cached_tokens=5, reasoning_tokens=1)),
    )
    client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)

    completion = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-Sidequest-Purpose": "answer"},
    )

    assert completion.choices[0].message.content == "Hello"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.prompt_tokens == 20
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 5
    client.close()


def test_non_streaming_anthropic_reply_through_the_sdk(server: ScriptedServer) -> None:
    server.script("answer", Step.truncated("Cut off", usage=Usage(30, 9, cached_tokens=10)))
    client = anthropic.Anthropic(base_url=server.root_url, api_key="k", max_retries=0)

    message = client.messages.create(
        model="m",
        max_tokens=9,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-Sidequest-Purpose": "answer"},
    )

    assert message.stop_reason == "max_tokens"
    assert message.content[0].type == "text" and message.content[0].text == "Cut off"
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (20, 10)
    client.close()


def test_streaming_usage_is_only_sent_when_include_usage_is_asked(server: ScriptedServer) -> None:
    server.script("answer", Step.text("a", usage=Usage(1, 1)), Step.text("b", usage=Usage(1, 1)))
    with_usage = post(server, "answer", {"stream": True, "stream_options": {"include_usage": True}})[1]
    without = post(server, "answer", {"stream": True})[1]
    assert b'"usage"' in with_usage
    assert b'"usage"' not in without
    assert with_usage.rstrip().endswith(b"data: [DONE]")


def test_another_process_can_reach_the_server(server: ScriptedServer) -> None:
    script = (
        "import json, sys, urllib.request\n"
        "r = urllib.request.Request(sys.argv[1], data=b'{}', headers={'x-sidequest-purpose': 'answer'})\n"
        "print(json.loads(urllib.request.urlopen(r, timeout=5).read())['choices'][0]['message']['content'])\n"
    )
    server.script("answer", Step.text("from a subprocess"))

    out = subprocess.run(
        [sys.executable, "-c", script, server.base_url + "/chat/completions"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout

    assert out.strip() == "from a subprocess"


def test_stopping_ends_a_hanging_reply() -> None:
    with ScriptedServer() as server:
        server.script("answer", Step.hang())
        outcome: list[object] = []

        def call() -> None:
            try:
                outcome.append(post(server, "answer", {}))
            except Exception as exc:
                outcome.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        deadline = time.monotonic() + 5
        while not server.requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
    thread.join(5)
    assert not thread.is_alive()
    assert time.monotonic() - started < 3
    assert outcome  # the client got an error (connection closed), not a hang
