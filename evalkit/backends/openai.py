"""backend=openai: any OpenAI-compatible completions server, one per variant (vLLM, SGLang, llama.cpp's server).

`'backend.endpoints={baseline:"http://127.0.0.1:8000/v1",fp8:"http://127.0.0.1:8001/v1"}'`: the baseline's server
holds the full-precision KV cache, each other one the flag under test (`vllm serve MODEL --kv-cache-dtype fp8`).
Every sample's prompt, rendered by evalkit with the task's template, is sent as text with temperature 0 and a fixed
seed; `logprobs` top tokens are asked for, and where the servers return them a variant's fidelity to the baseline
(top-1 agreement, KL on the returned tokens) is recorded. Before any sample runs, each server must answer, serve the
same model as the others, and decode greedily: two identical requests must give one answer, and where log
probabilities come back, each chosen token must be the server's own most likely one. A server's cache is not
observable over HTTP: KV bytes follow from the dtype declared for it (evalkit.plan's arithmetic), labelled so.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
import openai

from evalkit.arch import ELEMENT, Arch, arch_from_config
from evalkit.backends import BackendSpec, Job, Result, check_generates, check_variants_unused
from evalkit.backends.agreement import top_tokens
from evalkit.backends.kvbytes import CACHE_TYPES, DECLARED, declared_bytes, per_element
from evalkit.errors import ConfigError
from evalkit.fields import check_fields
from evalkit.records import BASELINE
from evalkit.records.checks import shared_endpoints
from evalkit.sources import read_source

FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's and SGLang's --kv-cache-dtype names: one byte per value
NOT_OBSERVED = {
    "tokens_held_per_layer": "a server does not report its cache per layer",
    "tokens_allocated_per_layer": "a server does not report its cache per layer",
    "evidence_retained_per_layer": "a server does not report which tokens its cache holds",
    "kv_bytes": "a server does not report its cache: bytes follow from the declared KV dtype (kv_bytes_source)",
    "attention_path": "a server does not report its attention kernel",
}
RANGES = (("logprobs", 0, 20), ("concurrency", 1, 256), ("retries", 0, 20), ("timeout", 1, 3600))
TOLERANCE = 1e-3  # nats: a chosen token whose logprob is this far below the best returned one was not the argmax


@dataclass
class Completion:
    """One server's answer: text, tokens and their top log-probabilities where returned, token counts, seconds."""

    text: str
    tokens: list[str]
    top: list[dict[str, float]] | None
    chosen_logprobs: list[float] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    seconds: float


@dataclass(kw_only=True)
class OpenAI:
    """The openai backend's settings (conf/backend/openai.yaml) and, once opened, its clients."""

    name: str = "openai"
    endpoints: dict[str, str] | None = None
    kv_dtypes: dict[str, str] | None = None
    model: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    seed: int = 0
    logprobs: int = 5
    concurrency: int = 4
    timeout: float = 120.0
    retries: int = 4
    extra: dict[str, Any] | None = None
    _clients: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _arch: Arch | None = field(default=None, init=False, repr=False)
    _served: str = field(default="", init=False, repr=False)
    _version: str | None = field(default=None, init=False, repr=False)
    _fidelity: str | None = field(default=None, init=False, repr=False)  # why there is none, when there is none
    _owner: str = field(default="", init=False, repr=False)
    _warned: bool = field(default=False, init=False, repr=False)

    def check(self, spec: BackendSpec, task: Any) -> None:
        check_fields(self, "backend")
        self.endpoints, self.kv_dtypes = dict(self.endpoints or {}), dict(self.kv_dtypes or {})
        self.extra = dict(self.extra or {})
        check_generates(self.name, task)
        check_variants_unused(spec, self.name)
        if spec.variants:
            raise ConfigError(
                "backend=openai takes its variants from backend.endpoints (one server each): drop variants=[...] and "
                "give 'backend.endpoints={baseline:URL,fp8:URL}'"
            )
        if BASELINE not in self.endpoints or len(self.endpoints) < 2:
            raise ConfigError(
                "backend=openai needs the baseline's server and at least one variant's: "
                '\'backend.endpoints={baseline:"http://127.0.0.1:8000/v1",fp8:"http://127.0.0.1:8001/v1"}\''
            )
        for name, url in self.endpoints.items():
            parsed = urlparse(str(url))
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ConfigError(
                    f"backend.endpoints.{name}={url!r} is not an http(s) URL; give e.g. http://HOST:PORT/v1"
                )
        shared = shared_endpoints(self.endpoints)
        if shared:
            raise ConfigError(
                f"backend.endpoints: {shared}: a server compared with itself shows no difference whatever its KV "
                "cache holds; give each variant the server started with its own KV setting"
            )
        unknown = sorted(set(self.kv_dtypes) - set(self.endpoints))
        if unknown:
            raise ConfigError(f"backend.kv_dtypes names {unknown}, which backend.endpoints lacks")
        for name in self.endpoints:
            self.kv_dtype(name)
        for key, least, most in RANGES:
            if not least <= getattr(self, key) <= most:
                raise ConfigError(f"backend.{key}={getattr(self, key)!r}: give a number from {least} to {most}")

    def kv_dtype(self, name: str) -> str:
        """The KV dtype declared for endpoint `name`: backend.kv_dtypes, else bfloat16 for the baseline and the
        endpoint's own name where it names a dtype (`fp8`)."""
        dtype = self.kv_dtypes.get(name) or ("bfloat16" if name == BASELINE else name)
        dtype = "fp8" if dtype in FP8 else dtype
        if dtype not in ELEMENT and dtype not in CACHE_TYPES:
            raise ConfigError(
                f"endpoint {name!r}: declare the KV dtype its server holds, 'backend.kv_dtypes={{{name}:fp8}}' (one of "
                f"{sorted(ELEMENT) + list(CACHE_TYPES)}): the bytes cannot be observed over HTTP"
            )
        return dtype

    def variant_names(self) -> list[str]:
        return [n for n in self.endpoints if n != BASELINE]

    def open(self, spec: BackendSpec, jobs: list[Job]) -> dict[str, Any]:
        for client_log in ("httpx", "httpx2"):  # the HTTP client logs every request at INFO, into Hydra's job log
            logging.getLogger(client_log).setLevel(logging.WARNING)
        key = os.environ.get(self.api_key_env) or "EMPTY"  # local servers take any key; never recorded
        self._clients = {
            name: openai.OpenAI(base_url=str(url), api_key=key, timeout=self.timeout, max_retries=self.retries)
            for name, url in self.endpoints.items()
        }
        self._served = self._check_models()
        self._version = self._engine_version()
        self._arch = arch_from_config(read_source(spec.model).raw, spec.model.name)
        if jobs:
            self._check_greedy(jobs[0])
        return {
            "engine": {
                "backend": self.name,
                "engine_version": self._version or "not reported (the server answers no GET /version)",
                "endpoints": dict(self.endpoints),
                "kv_dtypes": {n: self.kv_dtype(n) for n in self.endpoints},
                "served_model": self._served,
                "fidelity": self._fidelity or f"top-{self.logprobs} log-probabilities",
                "concurrency": self.concurrency,
                "timeout": self.timeout,
                "retries": self.retries,
                "extra": dict(self.extra),
            },
            "model": {
                "name": self._served,
                "fingerprint": self._served,
                "source": f"served at {self.endpoints[BASELINE]}",
            },
        }

    def _probe(self, name: str):
        """The endpoint's client for start-up checks: one try (a dead server refuses the connection at once), waiting
        backend.timeout like every request: a long prompt's prefill on a loaded server takes what it takes."""
        return self._clients[name].with_options(max_retries=0)

    def _check_models(self) -> str:
        """The served model: each endpoint must answer and list the same one."""
        listed = {}
        for name, url in self.endpoints.items():
            try:
                models = list(self._probe(name).models.list())
                listed[name] = [m.id for m in models]
                if name == BASELINE and models:
                    self._owner = str(getattr(models[0], "owned_by", "") or "")
            except openai.APIConnectionError as err:
                raise ConfigError(
                    f"backend.endpoints.{name}={url} is unreachable ({_cause(err)}): start its server, or fix the URL"
                ) from None
            except openai.APIStatusError as err:
                raise ConfigError(
                    f"backend.endpoints.{name}={url} answered {err.status_code} to GET /models: give the server's "
                    f"OpenAI base URL (ending in /v1){'; set $' + self.api_key_env if err.status_code == 401 else ''}"
                ) from None
        served = self.model or (listed[BASELINE] or [""])[0]
        wrong = {n: ids for n, ids in listed.items() if served not in ids}
        if wrong:
            name, ids = next(iter(wrong.items()))
            raise ConfigError(
                f"model-name mismatch: the endpoints must serve the same model, but {name} serves {ids} and the "
                f"baseline {listed[BASELINE]}; start every server on the same model and name (vLLM: "
                "--served-model-name), or name the model with backend.model=..."
            )
        return served

    def _engine_version(self) -> str | None:
        """What the baseline's server says it is: vLLM and SGLang answer GET /version and name themselves as the
        models' owner (`vllm 0.9.2`); llama.cpp's Python server does neither (None, said in run.json)."""
        root = str(self.endpoints[BASELINE]).rstrip("/").removesuffix("/v1")
        try:
            reply = httpx.get(f"{root}/version", timeout=5.0)
            version = reply.json().get("version") if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            version = None
        return f"{self._owner or 'server'} {version}" if version else None

    def _check_greedy(self, job: Job) -> None:
        """Refuse a server that does not decode greedily: two identical requests must give one answer (and each
        answer passes _not_argmax)."""
        for name in self.endpoints:
            first = self._complete(name, job, probe=True)
            second = self._complete(name, job, probe=True)
            if first.text != second.text:
                raise ConfigError(
                    f"endpoint {name} ({self.endpoints[name]}) is not deterministic at temperature 0: two identical "
                    f"requests gave two answers ({first.text[:40]!r} and {second.text[:40]!r}): it samples anyway "
                    "(an override in front of it?) or its numerics depend on earlier requests (prefix caching, "
                    "batching); its rows would not be reproducible"
                )
            self._not_argmax(name, first)

    def _not_argmax(self, name: str, c: Completion) -> None:
        """Where log probabilities came back, every chosen token must be the most likely one the server returned:
        a ConfigError otherwise (a repetition penalty, a sampling override)."""
        for i, (lp, top) in enumerate(zip(c.chosen_logprobs or [], c.top or [], strict=False)):
            best = max(top.values(), default=lp)
            if lp is not None and lp < best - TOLERANCE:
                raise ConfigError(
                    f"endpoint {name} does not decode greedily at temperature 0: answer token {i} {c.tokens[i]!r} has "
                    f"logprob {lp:.3f}, below the server's best {best:.3f} (a repetition penalty? llama.cpp's server "
                    "applies repeat_penalty=1.1 unless told: add 'backend.extra={repeat_penalty:1.0}')"
                )

    def _complete(self, name: str, job: Job, probe: bool = False) -> Completion:
        """One greedy completion of the job's prompt text from endpoint `name`."""
        client = self._probe(name) if probe else self._clients[name]
        asked = self.logprobs if self._fidelity is None else 0
        kwargs = {"logprobs": asked} if asked else {}
        start = time.perf_counter()
        try:
            reply = client.completions.create(
                model=self._served,
                prompt=job.text,
                max_tokens=job.max_new_tokens,
                temperature=0.0,
                seed=self.seed,
                extra_body=self.extra or None,
                **kwargs,
            )
        except openai.BadRequestError as err:
            if asked and probe:  # a server that cannot return log probabilities: no fidelity, said in the rows
                self._fidelity = f"not returned: {name} refused logprobs ({_cause(err)})"
                return self._complete(name, job, probe)
            raise ConfigError(
                f"endpoint {name} refused the request ({_cause(err)}): fix the server's settings (its context length) "
                "or backend.extra"
            ) from None
        except openai.APITimeoutError:
            where = f"on sample {job.sample_id!r}, {self.retries} retries" if not probe else "at start"
            raise ConfigError(
                f"endpoint {name} ({self.endpoints[name]}) did not answer {where} within backend.timeout="
                f"{self.timeout:g} s (waited {time.perf_counter() - start:.0f} s): the rows written so far are kept; "
                "give the server more time (backend.timeout=SECONDS), then resume=true"
            ) from None
        except (openai.APIConnectionError, openai.APIStatusError) as err:
            where = f"on sample {job.sample_id!r}, retried up to {self.retries} times" if not probe else "at start"
            raise ConfigError(
                f"endpoint {name} ({self.endpoints[name]}) failed {where} ({_cause(err)}): the rows written so far "
                "are kept; fix the server, then resume=true"
            ) from None
        seconds = time.perf_counter() - start
        choice = reply.choices[0]
        lp = getattr(choice, "logprobs", None)
        if asked and probe and (lp is None or not lp.top_logprobs):
            self._fidelity = f"not returned: {name} gave no logprobs"
        usage = reply.usage
        completion = Completion(
            choice.text,
            list(lp.tokens) if lp is not None and lp.tokens else [],
            [dict(t) for t in lp.top_logprobs] if lp is not None and lp.top_logprobs else None,
            list(lp.token_logprobs) if lp is not None and lp.token_logprobs else None,
            usage.prompt_tokens if usage else None,
            usage.completion_tokens if usage else None,
            seconds,
        )
        if not probe:  # the start-up probe checks in its own order (_check_greedy)
            self._not_argmax(name, completion)
        return completion

    def run(self, jobs: list[Job]) -> Iterator[tuple[Job, list[Result]]]:
        """Each job's results in order; at most `concurrency` requests in flight, a few jobs submitted ahead."""
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="evalkit-openai")
        ahead: deque[tuple[Job, dict[str, Future]]] = deque()
        todo = iter(jobs)
        try:
            while True:
                while len(ahead) < self.concurrency + 1 and (job := next(todo, None)) is not None:
                    names = [BASELINE, *job.variants]
                    ahead.append((job, {n: pool.submit(self._complete, n, job) for n in names}))
                if not ahead:
                    return
                job, futures = ahead.popleft()
                done = {n: f.result() for n, f in futures.items()}
                self._warn_tokenization(job, done[BASELINE])
                yield job, [self._result(n, job, c, done[BASELINE]) for n, c in done.items()]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _warn_tokenization(self, job: Job, c: Completion) -> None:
        """Say once when a server counts another number of prompt tokens than evalkit did: its tokenizer or the
        way it parses special tokens in the text differs from `model`'s (rows keep both counts)."""
        if self._warned or c.prompt_tokens is None or c.prompt_tokens == len(job.ids):
            return
        self._warned = True
        print(
            f"evalkit: warning: the baseline's server read {c.prompt_tokens} prompt tokens of sample {job.sample_id!r} "
            f"where evalkit's tokenizer made {len(job.ids)} (rows: server_prompt_tokens, prompt_tokens); check that "
            "model= is the served model",
            file=sys.stderr,
        )

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def _result(self, name: str, job: Job, c: Completion, base: Completion) -> Result:
        dtype = self.kv_dtype(name)
        prompt = c.prompt_tokens if c.prompt_tokens is not None else len(job.ids)
        held = declared_bytes(self._arch, prompt, dtype)
        final = declared_bytes(self._arch, prompt + (c.completion_tokens or 0), dtype)
        is_base = name == BASELINE
        if is_base or self._fidelity is not None or c.top is None or base.top is None:
            fidelity = None
        else:
            fidelity = top_tokens(base.top, c.top, base.tokens, c.tokens)
        fields = {
            "backend": self.name,
            "engine_version": self._version,
            "policy": {"name": BASELINE} if is_base else {"name": "none", "budget": 1.0},
            "quant": None
            if is_base or dtype == self.kv_dtype(BASELINE)
            else {"name": dtype, "engine": "server", "kv_dtype": dtype, "declared": True},
            "prefill": {"mode": "oneshot"},
            "kv_bytes": held,
            "kv_bytes_deployed": held,
            "kv_bytes_final": final,
            "peak_kv_bytes": final,
            "decode_peak_kv_bytes_deployed": final,  # the cache decoded from grows to its largest at the end
            "kv_bytes_source": f"{DECLARED}: {dtype}, {per_element(dtype):g} bytes per value (evalkit.plan)",
            "prefill_peak_kv_bytes": held,
            "prefill_peak_tokens": prompt,
            "prefill_bound_tokens": None,
            "tokens_held_per_layer": None,
            "tokens_allocated_per_layer": None,
            "evidence_retained_per_layer": None,
            "attention_path": None,
            "not_observed": {
                **NOT_OBSERVED,
                **({"fidelity": self._fidelity} if self._fidelity else {}),
                **({} if self._version else {"engine_version": "the server answers no GET /version"}),
            },
            "server_prompt_tokens": c.prompt_tokens,
            "generated_tokens": c.completion_tokens if c.completion_tokens is not None else len(c.tokens),
            "seconds": {"request": round(c.seconds, 4)},
            "fidelity": fidelity,
        }
        return Result(name, c.text.strip(), fields)


def _cause(err: Exception) -> str:
    """The first line of an error and of what caused it."""
    cause = err.__cause__ or err.__context__
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if cause is not None and str(cause).strip():
        text += f": {str(cause).strip().splitlines()[0]}"
    return text[:300]
