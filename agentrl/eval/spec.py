"""The evaluation spec: what to evaluate (environment, dataset, model), how to sample, which metrics.

It is the body of ``POST /v1/evals`` and the content of an ``agentrl eval CONFIG.yaml`` file. Unknown fields
are errors. Checks that need the world (does the dataset file exist, is the environment registered) are made
when the spec is loaded (:func:`agentrl.eval.datasets.load_tasks`, :func:`agentrl.eval.engines.check_model`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from agentrl.models import NAMED_MODELS, is_model_ref

MAX_ITEMS = 10_000
MAX_SAMPLES = 100_000  # items x samples_per_item


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _to_str(value: Any) -> Any:
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


class EnvironmentSpec(_Strict):
    """A registered environment (see ``GET /v1/environments``) and its constructor options."""

    name: str = Field(default="retool", min_length=1, max_length=128, description="registered environment name")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the environment")


class ChatMessage(BaseModel):
    """One chat message of a prompt given as a conversation."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=100_000)


class DatasetItem(BaseModel):
    """One problem. ``prompt``: a string, or chat messages (the environment's system prompt is added only when
    they hold no system message). Extra fields (e.g. ``tests`` for code environments) go to the task's metadata."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [{"prompt": "What is 17 * 23?",
                                                                               "answer": "391"}]})

    id: str | None = Field(default=None, max_length=256)
    prompt: Annotated[str, Field(min_length=1, max_length=100_000)] | Annotated[
        list[ChatMessage], Field(min_length=1, max_length=256)]
    answer: Annotated[str | None, BeforeValidator(_to_str)] = Field(default=None, max_length=10_000)


class DatasetSpec(_Strict):
    """Exactly one of: inline ``items``, a registered dataset ``name``, or a server-side ``path`` (a .jsonl,
    .json, .parquet or .arrow file, or a save_to_disk folder, read with ``prompt_key`` / ``answer_key``)."""

    items: list[DatasetItem] | None = Field(default=None, min_length=1, max_length=MAX_ITEMS)
    name: str | None = Field(default=None, min_length=1, max_length=128,
                             description="a named dataset (GET /v1/datasets), e.g. 'arithmetic:heldout' (a generator: "
                                         "sized by n and seed) or a benchmark file or plugin of the server")
    version: str | None = Field(default=None, min_length=1, max_length=128,
                                description="version of the named dataset (default: its latest); filled in when the "
                                            "task is submitted")
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
                               description="the content's sha256 (GET /v1/datasets/{name}); given: the task is refused "
                                           "unless the content matches; filled in when the task is submitted")
    path: str | None = Field(default=None, min_length=1, max_length=4096,
                             description="a dataset on the server: .jsonl, .json, .parquet, .arrow or a "
                                         "save_to_disk folder")
    prompt_key: str = Field(default="prompt", min_length=1, max_length=256,
                            description="column of the prompt (a string or chat messages) in a `path` dataset; "
                                        "a dotted path reaches into nested columns")
    answer_key: str | None = Field(default="answer", min_length=1, max_length=256,
                                   description="column of the reference answer in a `path` dataset, e.g. "
                                               "reward_model.ground_truth; null: the dataset has no answers")
    n: int = Field(default=20, ge=1, le=MAX_ITEMS, description="items drawn from a registered dataset")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="seed of a registered dataset")
    limit: int | None = Field(default=None, ge=1, le=MAX_ITEMS, description="keep only the first `limit` items")

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        given = [k for k in ("items", "name", "path") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of 'items', 'name' or 'path' (got {given or 'none'})")
        if self.version is not None and self.name is None:
            raise ValueError("'version' goes with 'name' (a named dataset)")
        return self

    def size_hint(self) -> int | None:
        """Items this spec yields, if known without reading a file."""
        n = len(self.items) if self.items is not None else self.n if self.name is not None else None
        return min(n, self.limit) if n is not None and self.limit is not None else n


def check_model_url(url: str) -> str:
    """The one check of a model server's URL (``url``, ``openai_url``): http(s), a host, no credentials in it
    (an API key goes in the environment variable ``api_key_env`` names). Returns it without a trailing slash.
    (A server-side allow-list of model URLs belongs here too.)"""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a malformed port
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a URL: {exc}") from None
    del port
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:30000/v1")
    if parts.username is not None or parts.password is not None:
        raise ValueError("the URL must not hold credentials: put the API key in an environment variable of the "
                         "server and name it in 'api_key_env'")
    return url.rstrip("/")


ModelUrl = Annotated[str, Field(min_length=8, max_length=2048, pattern=r"^https?://\S+$"),
                     AfterValidator(check_model_url)]
#: default deadline of one chat-completions call of an ``openai_url`` model, retries included
OPENAI_TIMEOUT_S = 300.0


class ModelSpec(_Strict):
    """Exactly one of: a ``name`` (a bundled model or a Hugging Face id ``Org/Name[@REVISION]`` from the server's
    local HF cache, never downloaded), a model folder ``path``, a training run's weight version
    (``run`` + ``version`` = ``runs/<run>/weights/v<version>``), the ``url`` of a running SGLang server, or the
    ``openai_url`` of any OpenAI-compatible chat-completions server (text level: no token ids, logprobs or weight
    versions in the records, which say ``token_level: false``). For ``name``, ``path`` and ``run`` the service
    starts (and reuses) an SGLang server."""

    name: str | None = Field(default=None, max_length=256,
                             description=f"bundled model ({', '.join(NAMED_MODELS)}) or a Hugging Face id "
                                         "Org/Name[@REVISION] in the server's local HF cache")
    path: str | None = Field(default=None, min_length=1, max_length=4096, description="a local HF model folder")
    run: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$",
                            description="training run name (its weights are in runs/<run>/weights/)")
    version: int | None = Field(default=None, ge=0, le=10**9, description="weight version of `run`")
    url: ModelUrl | None = Field(default=None, description="a running SGLang server, e.g. http://127.0.0.1:30000")
    openai_url: ModelUrl | None = Field(
        default=None, description="an OpenAI-compatible server's base URL, e.g. http://127.0.0.1:30000/v1 (SGLang's "
                                  "own OpenAI route) or https://api.example.com/v1; its /chat/completions is called")
    openai_model: str | None = Field(default=None, min_length=1, max_length=256,
                                     description="model name sent to `openai_url` (default: the first of its "
                                                 "GET /models)")
    api_key_env: str | None = Field(default=None, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="name of the server's environment variable holding the API key of "
                                                "`openai_url` (never the key itself)")
    openai_timeout_s: float | None = Field(default=None, gt=0, le=3600,
                                           description="deadline of one chat-completions call, retries included "
                                                       f"(default {OPENAI_TIMEOUT_S:g})")
    tokenizer: str | None = Field(default=None, min_length=1, max_length=4096,
                                  description="bundled name, Hugging Face id or folder of the tokenizer "
                                              "(default: the model's)")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        given = [k for k in ("name", "path", "run", "url", "openai_url") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'name', 'path', 'run' (+ 'version'), 'url' or 'openai_url' "
                             f"(got {given or 'none'})")
        if self.openai_url is None:
            extra = [k for k in ("openai_model", "api_key_env", "openai_timeout_s") if getattr(self, k) is not None]
            if extra:
                raise ValueError(f"{', '.join(repr(k) for k in extra)} go with 'openai_url' only")
        elif self.tokenizer is not None:
            raise ValueError("'tokenizer' does not apply to 'openai_url': the server tokenizes (no token-level records)")
        if (self.run is None) != (self.version is None):
            raise ValueError("'run' and 'version' go together: the weights in runs/<run>/weights/v<version>")
        if self.name is not None and not is_model_ref(self.name):
            raise ValueError(f"unknown model name {self.name!r}: expected a bundled model ({', '.join(NAMED_MODELS)}) "
                             "or a Hugging Face id Org/Name[@REVISION] (use 'path' for a model folder)")
        if self.run is not None and self.run in (".", ".."):
            raise ValueError("'run' must be a run name, not '.' or '..'")
        return self


class SamplingSpec(_Strict):
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=100_000, description="-1: no top-k")
    max_new_tokens: int = Field(default=256, ge=1, le=32_768, description="per model turn")
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1,
                             description="sample s of item i uses seed + i * samples_per_item + s (SGLang honours "
                                         "it when started with --enable-deterministic-inference)")
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list, max_length=16,
                                                                           description="extra stop strings")


EXAMPLE: dict[str, Any] = {
    "environment": {"name": "retool", "options": {}},
    "dataset": {"items": [{"prompt": "What is 17 * 23 + 5?", "answer": "396"}]},
    "model": {"name": "tiny"},
    "sampling": {"temperature": 1.0, "max_new_tokens": 256},
    "samples_per_item": 4,
    "pass_k": [1, 4],
    "max_turns": 4,
}


class EvalSpec(_Strict):
    """An evaluation: ``samples_per_item`` episodes of ``environment`` per ``dataset`` item on ``model``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [EXAMPLE]})

    name: str = Field(default="", max_length=200, description="a label for humans")
    environment: EnvironmentSpec = Field(default_factory=EnvironmentSpec)
    dataset: DatasetSpec
    model: ModelSpec
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    samples_per_item: int = Field(default=1, ge=1, le=256)
    pass_k: list[int] = Field(default_factory=lambda: [1], min_length=1, max_length=16,
                              description="k values of pass@k; each at most samples_per_item")
    max_turns: int = Field(default=4, ge=1, le=64)
    max_response_tokens: int = Field(default=1024, ge=1, le=131_072, description="model + tool tokens after the prompt")
    max_context_tokens: int = Field(default=4096, ge=16, le=131_072)
    correct_threshold: float = Field(default=1.0, ge=-1e9, le=1e9,
                                     description="a sample is correct when its correctness score is >= this")
    max_concurrency: int = Field(default=8, ge=1, le=256, description="episodes of this evaluation running at once")
    sample_retries: int = Field(default=1, ge=0, le=5, description="retries of a sample whose infrastructure failed")
    max_consecutive_errors: int = Field(default=16, ge=1, le=10_000,
                                        description="fail the evaluation after this many failed samples in a row")
    episode_timeout_s: float = Field(default=600.0, gt=0, le=86_400)
    keep_trajectories: bool = Field(default=True, description="store each sample's full trajectory with its record")
    labels: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=256)]] = Field(
        default_factory=dict, max_length=32)
    group_by: str | None = Field(default=None, min_length=1, max_length=256,
                                 description="an item field (metadata; a dotted path reaches into nested ones), e.g. "
                                             "data_source or level: metrics and their intervals per group too")
    webhook_url: ModelUrl | None = Field(
        default=None, description="REST service only: POSTed the final state when the task ends, signed with "
                                  "HMAC-SHA256 (header X-Agentrl-Signature: sha256=<hex>); hosts the server allows")

    @model_validator(mode="after")
    def _check(self) -> EvalSpec:
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples_per_item]
        if bad:
            raise ValueError(f"pass_k values {bad} are outside [1, samples_per_item={self.samples_per_item}]: "
                             "pass@k needs at least k samples per item")
        self.pass_k = sorted(set(self.pass_k))
        n = self.dataset.size_hint()
        if n is not None and n * self.samples_per_item > MAX_SAMPLES:
            raise ValueError(f"{n} items x {self.samples_per_item} samples = {n * self.samples_per_item} episodes; "
                             f"the limit is {MAX_SAMPLES}: split the evaluation")
        return self
