"""API keys through the real HTTP app and the official openai SDK: who may call which model,
who may run the admin routes, rotation without a restart, and strict request types."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from packserve import auth
from packserve.cli import main
from packserve.core.events import RequestEvent
from packserve.errors import ConfigError, RateLimited
from tests.factories import (
    TIMEOUT,
    Running,
    config_from,
    cpu_device,
    fake_config,
    fake_model,
    serve,
    serve_process,
)

MODELS = (cpu_device("1GiB")
          + fake_model("emb", 'device = "cpu"', tasks='["embed", "rerank"]', source="fake:16MiB")
          + fake_model("gen", 'device = "cpu"', tasks='["chat", "complete"]', source="fake:16MiB"))

def keyed_config_text(keys_file: Path, views: str = "admin") -> str:
    return (f'[server]\nkeys_file = "{keys_file}"\noperator_views = "{views}"\n'
            + MODELS)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    minted = {"search": auth.mint(path, "search", ["emb"], admin=False),
              "ops": auth.mint(path, "ops", ["*"], admin=True)}
    return path, minted


@pytest.fixture(scope="module")
def server(keys: tuple[Path, dict[str, str]],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    path, _ = keys
    with serve(config_from(tmp_path_factory.mktemp("srv"), keyed_config_text(path))) as running:
        yield running


_OPENED: list[openai.OpenAI] = []


def sdk(server: Running, key: str) -> openai.OpenAI:
    """An SDK client for `key`, closed after the test (a socket left to the collector is an
    error, charged to whichever test is running when it is collected)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    _OPENED.append(client)
    return client


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _OPENED:
        _OPENED.pop().close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_no_key_or_a_wrong_key_is_401(server: Running) -> None:
    # (the SDK itself refuses to send no key at all; a plain client can)
    with pytest.raises(openai.AuthenticationError, match="not valid"):
        sdk(server, "psk-not-a-key").embeddings.create(model="emb", input="x")
    with server.client() as c:
        err = error_of(c.post("/v1/embeddings", json={"model": "emb", "input": "x"}), 401)
        assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
        assert c.get("/healthz").status_code == 200  # open
        assert c.get("/health").status_code == 200  # vLLM's name for it, open too
        assert c.get("/readyz").status_code == 200


def test_a_key_calls_its_models_and_learns_nothing_of_others(
        server: Running, keys: tuple[Path, dict[str, str]]) -> None:
    client = sdk(server, keys[1]["search"])
    out = client.embeddings.create(model="emb", input=["hello"])
    assert len(out.data) == 1
    assert [m.id for m in client.models.list()] == ["emb"]
    with pytest.raises(openai.NotFoundError) as other:
        client.chat.completions.create(model="gen", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    # the same answer for a model out of scope and one that does not exist; only "emb" listed
    assert str(other.value).replace("'gen'", "'nope'") == str(missing.value)
    assert str(missing.value).endswith("does not exist or you have no access to it; key "
                                       "'search' may call: emb")
    assert [m.id for m in sdk(server, keys[1]["ops"]).models.list()] == ["emb", "gen"]


def test_only_an_admin_key_may_send_keep_alive(
        server: Running, keys: tuple[Path, dict[str, str]]) -> None:
    """Ollama's per-request keep_alive changes the model for every client: a plain key gets
    403 naming the field, through the SDK as a client would send it (`extra_body`)."""
    with sdk(server, keys[1]["search"]) as plain, \
            pytest.raises(openai.PermissionDeniedError) as refused:
        plain.embeddings.create(model="emb", input="x", extra_body={"keep_alive": "5m"})
    assert "keep_alive" in str(refused.value) and "'search'" in str(refused.value)
    with server.client() as c:
        err = error_of(c.post("/v1/embeddings", headers=bearer(keys[1]["search"]),
                              json={"model": "emb", "input": "x", "keep_alive": 300}), 403)
        assert (err["type"], err["param"]) == ("permission_error", "keep_alive")
        bad = error_of(c.post("/v1/embeddings", headers=bearer(keys[1]["ops"]),
                              json={"model": "emb", "input": "x", "keep_alive": "5x"}), 400)
        assert "keep_alive" in str(bad["param"]) or "keep_alive" in bad["message"]
    with sdk(server, keys[1]["ops"]) as admin:
        out = admin.embeddings.create(model="emb", input="x", extra_body={"keep_alive": "5m"})
    assert len(out.data) == 1


def test_models_retrieve_hides_a_model_out_of_scope_as_if_missing(
        server: Running, keys: tuple[Path, dict[str, str]]) -> None:
    client = sdk(server, keys[1]["search"])
    assert client.models.retrieve("emb").id == "emb"
    with pytest.raises(openai.NotFoundError) as other:
        client.models.retrieve("gen")
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert str(other.value).replace("'gen'", "'nope'") == str(missing.value)
    assert sdk(server, keys[1]["ops"]).models.retrieve("gen").id == "gen"


def test_admin_routes_need_an_admin_key(server: Running,
                                        keys: tuple[Path, dict[str, str]]) -> None:
    search, ops = keys[1]["search"], keys[1]["ops"]
    with server.client() as c:
        err = error_of(c.post("/v1/residency/emb/load", headers=bearer(search)), 403)
        assert err["type"] == "permission_error" and "search" in err["message"]
        error_of(c.post("/v1/residency/emb/load"), 401)
        r = c.post("/v1/residency/emb/load", headers=bearer(ops))
        assert r.status_code == 200 and r.json()["state"] == "hot"
        # the read-only views are admin by default (operator_views = "admin")
        for path in ("/v1/residency", "/metrics", "/v1/metrics/summary", "/openapi.json"):
            error_of(c.get(path, headers=bearer(search)), 403)
            assert c.get(path, headers=bearer(ops)).status_code == 200, path


def test_metrics_and_events_carry_the_key_name_never_the_key(
        server: Running, keys: tuple[Path, dict[str, str]]) -> None:
    search, ops = keys[1]["search"], keys[1]["ops"]
    sdk(server, search).embeddings.create(model="emb", input=["one two three"])
    ended = [e for e in server.events if isinstance(e, RequestEvent) and e.key == "search"]
    assert ended and all(e.model == "emb" for e in ended)
    with server.client() as c:
        text = c.get("/metrics", headers=bearer(ops)).text
        summary = c.get("/v1/metrics/summary", headers=bearer(ops)).json()
    assert 'packserve_key_requests_total{code="200",key="search",model="emb"}' in text
    assert 'packserve_key_tokens_total{key="search",model="emb"}' in text
    assert search not in text and search not in str(summary)
    rows = [r for r in summary["cost"]["by_key"] if r["key"] == "search"]
    assert rows and rows[0]["model"] == "emb" and rows[0]["tokens"] >= 3


def wait_for(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not check():
        assert time.monotonic() < deadline, "the server never got there"
        time.sleep(0.1)


def test_keys_are_added_and_revoked_without_a_restart(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys.toml"
    first = auth.mint(path, "first", ["*"], admin=False)
    with serve(config_from(tmp_path, keyed_config_text(path))) as running, \
            running.client() as c:
        body = {"model": "emb", "input": "x"}
        assert c.post("/v1/embeddings", json=body, headers=bearer(first)).status_code == 200
        second = auth.mint(path, "second", ["emb"], admin=False)
        wait_for(lambda: c.post("/v1/embeddings", json=body,
                                headers=bearer(second)).status_code == 200)
        auth.revoke(path, "first")
        wait_for(lambda: c.post("/v1/embeddings", json=body,
                                headers=bearer(first)).status_code == 401)
        # a half-written file keeps the keys read before, and is logged, not obeyed
        path.write_text(path.read_text() + "\n[[keys]]\nname = ", "utf-8")

        def refused_to_reload() -> bool:
            assert c.post("/v1/embeddings", json=body,
                          headers=bearer(second)).status_code == 200
            return any("keys file not reloaded" in r.getMessage()
                       and "not valid TOML" in r.getMessage()
                       for r in caplog.records if r.name == "packserve.auth")

        wait_for(refused_to_reload)


def test_operator_views_can_be_open(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    plain = auth.mint(path, "plain", ["*"], admin=False)
    with serve(config_from(tmp_path, keyed_config_text(path, views="open"))) as running, \
            running.client() as c:
        assert c.get("/v1/residency").status_code == 200
        assert c.get("/metrics").status_code == 200
        error_of(c.post("/v1/residency/emb/load"), 401)
        error_of(c.post("/v1/residency/emb/load", headers=bearer(plain)), 403)


@pytest.mark.parametrize(("field", "value"), [
    ("stream", "yes"), ("stream", 1), ("max_tokens", "3"), ("temperature", "0.5"),
    ("seed", 1.5), ("n", "1"),
])
def test_wrong_json_types_are_refused_not_coerced(
        server: Running, keys: tuple[Path, dict[str, str]], field: str, value: object) -> None:
    body = {"model": "gen", "messages": [{"role": "user", "content": "hi"}], field: value}
    with server.client() as c:
        err = error_of(c.post("/v1/chat/completions", json=body,
                              headers=bearer(keys[1]["ops"])), 400)
    assert err["param"] == field and field in err["message"]


def test_a_network_address_needs_keys_or_an_explicit_risk(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="open_to_anyone"):
        config_from(tmp_path, '[server]\nhost = "0.0.0.0"\n' + MODELS)
    config_from(tmp_path, '[server]\nhost = "0.0.0.0"\nopen_to_anyone = true\n' + MODELS)
    config_from(tmp_path, '[server]\nhost = "::1"\n' + MODELS)  # loopback
    auth.mint(tmp_path / "k.toml", "k", ["*"], admin=True)
    config_from(tmp_path, '[server]\nhost = "0.0.0.0"\nkeys_file = "k.toml"\n' + MODELS)


def test_keys_cli_prints_the_key_once_and_keeps_only_its_digest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.toml"
    assert main(["keys", "create", "team-a", "--models", "emb,rerank-*", "--file", str(path)]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith(auth.KEY_PREFIX) and key not in path.read_text()
    assert path.stat().st_mode & 0o077 == 0  # only its owner can read the digests
    [found] = auth.parse_keys(path.read_text(), str(path))
    assert (found.name, found.models, found.admin) == ("team-a", ("emb", "rerank-*"), False)
    assert auth.KeyRing(path).find(key) == found and auth.KeyRing(path).find(key + "x") is None
    assert main(["keys", "create", "team-a", "--file", str(path)]) == 2
    assert "already has a key named 'team-a'" in capsys.readouterr().err
    assert main(["keys", "list", "--file", str(path)]) == 0
    assert capsys.readouterr().out.split() == ["team-a", "key", "emb,rerank-*", "-"]
    assert main(["keys", "revoke", "team-a", "--file", str(path)]) == 0
    assert auth.parse_keys(path.read_text(), str(path)) == ()


def test_the_key_ring_rereads_its_file_once_per_recheck_and_keeps_good_keys(
        tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    first = auth.mint(path, "first", ["*"], admin=False)
    now = [100.0]
    ring = auth.KeyRing(path, clock=lambda: now[0])
    second = auth.mint(path, "second", ["*"], admin=False)
    assert ring.find(second) is None  # within RECHECK_S of the last read: not looked at
    now[0] += auth.RECHECK_S
    assert ring.find(second) is not None and ring.find(first) is not None
    path.write_text(path.read_text() + "\n[[keys]]\nname = ", "utf-8")  # half written
    now[0] += auth.RECHECK_S
    assert ring.find(first) is not None and ring.find(second) is not None
    assert ring.error is not None and "not valid TOML" in ring.error
    path.write_text("", "utf-8")  # every key revoked
    now[0] += auth.RECHECK_S
    assert ring.find(first) is None and ring.error is None


@pytest.mark.parametrize(("text", "problem"), [
    ('[[keys]]\nname = "a"\nsha256 = "abc"\n', "64-character hex"),
    ('[[keys]]\nname = "a b"\nsha256 = "' + "0" * 64 + '"\n', "letters, digits"),
    ('[[keys]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\nadmin = "yes"\n', "admin"),
    (f'[[keys]]\nname = "a"\nsha256 = "{"0" * 64}"\n'
     f'[[keys]]\nname = "a"\nsha256 = "{"1" * 64}"\n', "two keys are named"),
    ('[other]\n', "unknown section"),
])
def test_a_bad_keys_file_is_refused_naming_the_problem(tmp_path: Path, text: str,
                                                      problem: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text, "utf-8")
    with pytest.raises(ConfigError, match=problem):
        auth.KeyRing(path)


def test_the_front_checks_keys_on_its_own_routes_and_before_relaying(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    plain = auth.mint(path, "plain", ["emb"], admin=False)
    admin = auth.mint(path, "admin", ["*"], admin=True)
    with serve_process(fake_config(tmp_path, keys_file=str(path)), tmp_path) as srv, \
            srv.client() as c:
        assert c.get("/healthz").status_code == 200
        error_of(c.post("/v1/embeddings", json={"model": "emb", "input": "x"}), 401)
        r = c.post("/v1/embeddings", json={"model": "emb", "input": "x"}, headers=bearer(plain))
        assert r.status_code == 200, r.text
        error_of(c.post("/v1/chat/completions", headers=bearer(plain), json={
            "model": "gen", "messages": [{"role": "user", "content": "x"}]}), 404)
        error_of(c.post("/v1/admin/reload", headers=bearer(plain)), 403)
        assert c.post("/v1/admin/reload", headers=bearer(admin)).status_code == 200
        error_of(c.get("/metrics", headers=bearer(plain)), 403)
        assert "packserve_engine_crashes_total" in c.get("/metrics", headers=bearer(admin)).text


# ------------------------------------------------------------------ each key's own limits


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def limited(**limits: Any) -> auth.Key:
    return auth.Key(name="team", digest=b"", models=("*",), admin=False, **limits)


def test_requests_per_second_is_a_token_bucket() -> None:
    clock = FakeClock()
    limits, key = auth.KeyLimits(clock), limited(requests_per_second=2.0)
    limits.admit(key)
    limits.admit(key)  # a burst of up to 2
    with pytest.raises(RateLimited, match="requests_per_second limit of 2") as refused:
        limits.admit(key)
    assert refused.value.retry_after_s == 1 and refused.value.status == 429
    clock.now = 0.5  # one more request's worth refilled
    limits.admit(key)


def test_concurrent_requests_and_tokens_per_minute() -> None:
    clock = FakeClock()
    limits = auth.KeyLimits(clock)
    one = limited(concurrent_requests=1)
    limits.admit(one)
    with pytest.raises(RateLimited, match="concurrent_requests"):
        limits.admit(one)
    limits.release(one, 0)
    limits.admit(one)
    tokens = limited(tokens_per_minute=60)  # one token a second
    limits.admit(tokens)
    limits.release(tokens, 100)  # a request may overdraw; the next ones wait it out
    with pytest.raises(RateLimited, match="tokens_per_minute") as refused:
        limits.admit(tokens)
    assert refused.value.retry_after_s == 41  # from -40 back to above zero at 1 token/s
    clock.now = 41
    limits.admit(tokens)


def test_a_key_over_its_limit_gets_429_with_retry_after(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    key = auth.mint(path, "one-at-a-time", ["*"], admin=False, concurrent_requests=1)
    other = auth.mint(path, "other", ["*"], admin=False)
    with serve(config_from(tmp_path, keyed_config_text(path))) as running, \
            running.client() as c:
        slow = ThreadPoolExecutor(1).submit(
            c.post, "/v1/chat/completions", headers=bearer(key),
            json={"model": "gen", "messages": [{"role": "user", "content": "@@sleep=2 x"}]})
        wait_for(lambda: any(m.name == "gen" and m.in_flight
                             for m in running.scheduler.models()))
        r = c.post("/v1/embeddings", headers=bearer(key), json={"model": "emb", "input": "x"})
        err = error_of(r, 429)
        assert err["code"] == "rate_limit_exceeded" and "one-at-a-time" in err["message"]
        assert r.headers["Retry-After"] == "1"
        # another key is not held back by this one's limit
        assert c.post("/v1/embeddings", headers=bearer(other),
                      json={"model": "emb", "input": "x"}).status_code == 200
        assert slow.result(timeout=TIMEOUT).status_code == 200
