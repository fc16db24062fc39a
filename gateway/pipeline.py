"""From a Messages request to the replica's generate request, and from the replica's
reply to usage.

The route handlers stay thin: they call `prepare`, send its request, then `usage_of`
and the ledger.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cachepoint.billing import BillingError, Buckets, buckets
from cachepoint.gateway.billing.ledger import NO_ATTRIBUTION, Attribution
from cachepoint.gateway.contract.breakpoints import (
    SCOPE_BETA,
    Breakpoint,
    CachePlan,
    ContractError,
    resolve,
)
from cachepoint.gateway.contract.encoding import PromptTooLong
from cachepoint.gateway.contract.fingerprint import (
    Fingerprint,
    betas_hash,
    fingerprint,
    params_hash,
)
from cachepoint.gateway.contract.prompt import RenderedPrompt
from cachepoint.gateway.contract.render import Renderer, degraded_headers
from cachepoint.gateway.contract.toolcalls import NO_FORCING, Forcing, forcing
from cachepoint.gateway.diagnostics import PreviousTurn, session_of
from cachepoint.gateway.errors import invalid
from cachepoint.gateway.fleet.upstream import UsageReportError
from cachepoint.gateway.profiles import profile_of
from cachepoint.gateway.schemas.messages import (
    CacheCreation,
    MessagesRequest,
    ThinkingEnabled,
    Usage,
    diagnostics_requested,
)
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.gateway.tenancy.tenants import KeyContext
from cachepoint.kvcore import MAX_LOOKBACK_BOUNDARIES
from cachepoint.protocol import BreakpointIn, CacheReport, GenerateRequest, KeySpanIn


@dataclass(frozen=True, slots=True)
class Prepared:
    rendered: RenderedPrompt  # tokens and block spans
    plan: CachePlan  # breakpoints, key spans, scope
    payload: GenerateRequest  # the replica's /v1/generate body
    forcing: Forcing = NO_FORCING  # the answer's forced opening (tool_choice any/tool)
    who: Attribution = NO_ATTRIBUTION  # session, user and requested model, for the ledger
    # cachepoint-degraded header ({} when nothing was); found here, in the intake thread,
    # because finding it walks every block
    degraded: dict[str, str] = field(default_factory=dict)
    # the prompt's fingerprint when the request opted in to cache diagnostics, else None
    fingerprint: Fingerprint | None = None
    # the response's `diagnostics` value (gateway/diagnostics.py), set once compared
    diagnosis: dict[str, Any] | None = None
    # the turn it was compared with, as the ledger billed it: what happened to its cache
    previous: PreviousTurn | None = None
    # what another API's request asked beyond its Messages form (OpenAI's sampling
    # and caching contract); MESSAGES for the Messages API
    options: ApiOptions = field(default_factory=lambda: MESSAGES)

    @property
    def session(self) -> str | None:
        """The session cache diagnostics compare this turn within (`session_for`)."""
        return session_for(self.who, self.options)


def session_for(who: Attribution, options: ApiOptions) -> str | None:
    """Claude Code's session (header or ``metadata.user_id``), else the one another
    API's request names (OpenAI's prompt_cache_key): what a turn is diagnosed within."""
    return session_of(who.session_id, who.user_id) or options.session


def tenant_key(ctx: KeyContext, settings: GatewaySettings) -> str:
    if settings.tenant_scope == "workspace" and ctx.workspace_id:
        return f"workspace:{ctx.workspace_id}"
    return f"org:{ctx.org_id}"


def plan_cache(
    rendered: RenderedPrompt,
    req: Any,
    ctx: KeyContext,
    betas: set[str],
    settings: GatewaySettings,
) -> CachePlan:
    try:
        return resolve(
            rendered,
            req.cache_control,
            model=req.model,
            tenant_key=tenant_key(ctx, settings),
            betas=betas,
            cache_key_betas=settings.cache_key_betas,
            policy=ctx.policy,
            min_cacheable_tokens=profile_of(settings, req.model).min_cacheable_tokens,
            block_size=settings.block_size,
        )
    except ContractError as exc:
        raise invalid(str(exc)) from exc


# NOTE: tokenizing stops once a prompt has this many times the model's window: up to
# there count_tokens and the context-limit 400 report the exact length (Claude Code reads
# the numbers); past it the 400 gives the count reached, a floor (contract/encoding.py).
COUNT_LIMIT_WINDOWS = 2


def count_limit(settings: GatewaySettings, model: str) -> int:
    """The most tokens rendering counts for ``model`` before it gives up."""
    return COUNT_LIMIT_WINDOWS * profile_of(settings, model).context_window


def render_prompt(
    req: Any, renderer: Renderer, limit: int | None = None
) -> tuple[RenderedPrompt, Forcing]:
    """The prompt the replica gets (what count_tokens counts), and the forcing in it.
    Past ``limit`` tokens, a 400 as soon as that is known, before tokenizing the rest."""
    try:
        forced = forcing(req)
    except ValueError as exc:
        raise invalid(str(exc)) from exc
    try:
        rendered = renderer.render(req, limit)
    except PromptTooLong as exc:
        # NOTE: Anthropic's words for a prompt longer than the window; "at least":
        # the count is where tokenizing stopped, not the whole prompt's length.
        raise invalid(
            f"prompt is too long: at least {exc.at_least} tokens > "
            f"{exc.limit // COUNT_LIMIT_WINDOWS} maximum (tokenizing stopped at "
            f"{COUNT_LIMIT_WINDOWS}x the context window)"
        ) from exc
    if forced.prefix:
        # NOTE: after every block, so it is input the request pays for at 1x and never
        # part of a cached prefix; encoded on its own, like every segment.
        tokens = rendered.tokens[:]
        tokens.extend(renderer.tokenizer.encode(forced.prefix))
        rendered = RenderedPrompt(tokens, rendered.blocks, rendered.applied_edits)
    return rendered, forced


# NOTE: with interleaved thinking the budget spans every thinking block of the turn,
# so Anthropic lets it exceed max_tokens.
INTERLEAVED_BETA = "interleaved-thinking-2025-05-14"
TTL_SECONDS = {"5m": 300, "1h": 3600, "24h": 86400}
DIAGNOSIS_BETA = "cache-diagnosis-2026-04-07"


def check_thinking(req: MessagesRequest, betas: set[str]) -> None:
    """Anthropic's rule for manual thinking (the shape is the schema's)."""
    thinking = req.thinking
    if not isinstance(thinking, ThinkingEnabled) or INTERLEAVED_BETA in betas:
        return
    if thinking.budget_tokens >= req.max_tokens:
        raise invalid(
            "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult "
            "our documentation at https://docs.claude.com/en/docs/build-with-claude/"
            "extended-thinking#max-tokens-and-context-window-size"
        )


def output_room(prompt_tokens: int, max_tokens: int, window: int, clamp: bool) -> int:
    """The max_tokens sent to the replica: as asked, or (``clamp``) lowered to what the
    window leaves. NOTE: Anthropic's exact wording, which Claude Code parses to retry
    with a smaller max_tokens; a prompt that fills the window alone fails either way."""
    if prompt_tokens + max_tokens <= window:
        return max_tokens
    if clamp and prompt_tokens < window:
        return window - prompt_tokens
    raise invalid(
        f"input length and `max_tokens` exceed context limit: {prompt_tokens} + "
        f"{max_tokens} > {window}, decrease input length or `max_tokens` and try again"
    )


@dataclass(frozen=True, slots=True)
class ApiOptions:
    """What a request on another API (OpenAI's) asks beyond the Messages request it
    becomes: sampling outside Anthropic's ranges, and OpenAI's caching contract."""

    temperature: float | None = None  # 0-2, for the payload (None: the request's own)
    seed: int | None = None  # the replica samples with it
    top_k: int | None = None  # vLLM's extension on OpenAI's API (-1 or 0: off)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    clamp: bool | None = None  # lower max_tokens to what the window leaves (None: the setting)
    # OpenAI's automatic caching: a prompt of at least this many tokens has what the
    # engine reused of it (whole blocks) billed as cached reads, and nothing as writes
    implicit_min: int | None = None
    # OpenAI's prompt_cache_retention "24h": such a prompt is also kept as a 24h entry
    # (kvcore retention), its write billed in the long-write bucket
    retain_24h: bool = False
    # cache diagnostics' session for a request without one of Claude Code's (OpenAI's
    # prompt_cache_key, scoped by the route): its turns are compared like a session's
    session: str | None = None


MESSAGES = ApiOptions()


def prepare(
    req: MessagesRequest,
    *,
    ctx: KeyContext,
    betas: set[str],
    settings: GatewaySettings,
    renderer: Renderer,
    request_id: str,
    who: Attribution = NO_ATTRIBUTION,
    options: ApiOptions = MESSAGES,
) -> Prepared:
    check_thinking(req, betas)
    rendered, forced = render_prompt(req, renderer, count_limit(settings, req.model))
    plan = _retained(plan_cache(rendered, req, ctx, betas, settings), rendered, options)
    stops = (req.stop_sequences or []) + ([forced.stop] if forced.stop else [])
    sampling = (req.temperature, req.top_p, req.top_k, stops)
    payload = _payload(
        rendered, plan, req.model, req.max_tokens, sampling, ctx, settings, request_id, options
    )
    fp = None
    if diagnostics_requested(req) or session_for(who, options):
        last = max(plan.breakpoints, key=lambda bp: bp.position, default=None)
        cached_end = last.position if last else 0
        if options.implicit_min is not None and last is None:
            # NOTE: OpenAI's automatic caching: what a later turn should read of this
            # one is its whole blocks, once the prompt reaches the minimum.
            n = len(rendered)
            cached_end = n // settings.block_size * settings.block_size
            cached_end = cached_end if n >= options.implicit_min else 0
        fp = fingerprint(
            rendered,
            model=req.model,
            # NOTE: the diagnostics beta itself opts in to nothing that changes a prompt,
            # and the scope beta only to a scope, which the fingerprint holds apart (a
            # turn without it is scope_changed, not a changed parameter).
            params=params_hash(req, betas - {DIAGNOSIS_BETA, SCOPE_BETA}),
            cached_end=cached_end,
            cached_ttl_s=TTL_SECONDS.get(last.ttl, 300) if last else 300,
            block_size=settings.block_size,
            key_betas=betas_hash(betas & set(settings.cache_key_betas)),
            scope=plan.scope,
            below_minimum=bool(plan.dropped_below_minimum),
        )
    degraded = degraded_headers(req)
    return Prepared(rendered, plan, payload, forced, who, degraded, fp, options=options)


@dataclass(frozen=True, slots=True)
class RawPrompt:
    """A prompt given as tokens (the legacy completions endpoint): what planning reads."""

    model: str
    cache_control: None = None  # no markers: OpenAI's caching is automatic


def prepare_tokens(
    tokens: Sequence[int],
    *,
    model: str,
    max_tokens: int,
    sampling: tuple[float | None, float | None, int | None, list[str]],
    ctx: KeyContext,
    settings: GatewaySettings,
    request_id: str,
    who: Attribution,
    options: ApiOptions,
) -> Prepared:
    """`prepare` for a prompt that is already tokens: no template, no blocks, no tools.
    ``sampling``: (temperature, top_p, top_k, stop sequences)."""
    rendered = RenderedPrompt(array("i", tokens), ())
    limit = count_limit(settings, model)
    if len(rendered) > limit:
        raise invalid(
            f"prompt is too long: {len(rendered)} tokens > {limit // COUNT_LIMIT_WINDOWS} maximum",
            param="prompt",
        )
    plan = _retained(
        plan_cache(rendered, RawPrompt(model), ctx, set(), settings), rendered, options
    )
    payload = _payload(
        rendered, plan, model, max_tokens, sampling, ctx, settings, request_id, options
    )
    return Prepared(rendered, plan, payload, NO_FORCING, who, options=options)


def _retained(plan: CachePlan, rendered: RenderedPrompt, options: ApiOptions) -> CachePlan:
    """OpenAI's ``"24h"`` retention: the whole prompt as one entry kept 24 hours in the
    org's keys (a prompt of at least the minimum), looking back on its block ends for
    the entry an earlier, shorter prompt kept."""
    n = len(rendered)
    if not options.retain_24h or options.implicit_min is None or n < options.implicit_min:
        return plan
    ends = sorted({s.end for s in rendered.blocks if 0 < s.end < n}, reverse=True)
    bp = Breakpoint(
        path="prompt",
        position=n,
        ttl="24h",
        scope="org",
        extra_keys=plan.key_spans[-1][1],
        boundaries=tuple(ends[: MAX_LOOKBACK_BOUNDARIES - 1]),
    )
    return replace(plan, breakpoints=(*plan.breakpoints, bp))


def _payload(
    rendered: RenderedPrompt,
    plan: CachePlan,
    model: str,
    max_tokens: int,
    sampling: tuple[float | None, float | None, int | None, list[str]],
    ctx: KeyContext,
    settings: GatewaySettings,
    request_id: str,
    options: ApiOptions,
) -> GenerateRequest:
    """The replica's generate request for a rendered and planned prompt."""
    temperature, top_p, top_k, stops = sampling
    if options.temperature is not None:
        temperature = options.temperature
    profile = profile_of(settings, model)
    clamp = settings.clamp_max_tokens if options.clamp is None else options.clamp
    room = output_room(len(rendered), max_tokens, profile.context_window, clamp)
    # NOTE: built unvalidated (model_construct): the replica validates what it is sent
    # and answers what breaks its limits (a 400 the client sees, as before the types),
    # and validating a long prompt's token list here would cost as much as encoding it.
    return GenerateRequest.model_construct(
        request_id=request_id,
        token_ids=rendered.tokens.tolist(),
        key_spans=[
            KeySpanIn.model_construct(start_block=s, extra_keys=list(k)) for s, k in plan.key_spans
        ],
        breakpoints=[
            BreakpointIn.model_construct(
                position=bp.position,
                ttl=bp.ttl,
                extra_keys=list(bp.extra_keys),
                boundaries=list(bp.boundaries),
            )
            for bp in plan.breakpoints
        ],
        max_tokens=room,
        temperature=1.0 if temperature is None else temperature,
        top_p=top_p or 1.0,
        top_k=max(0, options.top_k) if options.top_k is not None else (top_k or 0),
        stop_sequences=stops,
        stop_token_ids=list(profile.stop_token_ids),
        seed=options.seed,
        ignore_eos=options.ignore_eos,
        # NOTE: retention is charged to the org whatever the cache key (global scope,
        # tenant_scope=workspace): the quota is the org's (docs/gateway.md, Tenancy).
        retention_owner=f"org:{ctx.org_id}",
        owner_retained_share=ctx.retained_share,
        # NOTE: the gateway reads every generation as the replica's event stream, even
        # one the client wants whole (dispatch.py): so that a hang-up can stop it.
        stream=True,
    )


@dataclass(frozen=True, slots=True)
class ReportLimits:
    """What the gateway sent, and so what a replica's usage report must agree with."""

    prompt_tokens: int  # the rendered prompt's length: the report must say exactly this
    max_tokens: int  # no more output tokens than this may be billed
    # OpenAI's automatic caching (ApiOptions.implicit_min): engine hits of a prompt this
    # long are billed as reads, and nothing as writes; None: the Messages contract
    implicit_min: int | None = None

    @classmethod
    def of(cls, prepared: Prepared) -> ReportLimits:
        implicit = prepared.options.implicit_min
        return cls(len(prepared.rendered), prepared.payload.max_tokens, implicit)


def check_output(output_tokens: int, limits: ReportLimits) -> int:
    if output_tokens < 0 or output_tokens > limits.max_tokens:
        raise UsageReportError(f"{output_tokens} output tokens for max_tokens {limits.max_tokens}")
    return output_tokens


def buckets_of(cache: CacheReport, output_tokens: int, limits: ReportLimits) -> Buckets:
    """The replica's cache report is the only source; engine hits without a marker are
    not reads (contract §3). NOTE: the report is checked against what was sent, because
    a replica (or something posing as one) is not trusted to bill: the prompt length
    must match, the cached buckets must fit in it, and output is capped by max_tokens.
    (That its counts are integers at all, not ``1.5`` or ``true``, the strict decoding
    of its event saw to: cachepoint.protocol.decode_event.)"""
    prompt, read = cache.prompt_tokens, cache.entry_hit_tokens
    w5, w1 = cache.written_5m_tokens, cache.written_1h_tokens
    if limits.implicit_min is not None:
        # NOTE: OpenAI's contract: what the engine reused (whole blocks, in the org's
        # keys) is the cached part, for a prompt of at least the minimum; the rest is
        # input, with no write surcharge.
        read = cache.engine_hit_tokens if prompt >= limits.implicit_min else 0
        # A 24h entry's write is what it retains beyond what was reused, at the long
        # write's price; without one (in_memory) nothing is written.
        kept = cache.entry_hit_tokens + w1 if w1 else 0
        w5, w1 = 0, max(0, kept - read)
    if prompt != limits.prompt_tokens:
        raise UsageReportError(f"prompt_tokens {prompt} for a {limits.prompt_tokens}-token prompt")
    check_output(output_tokens, limits)
    try:
        return buckets(prompt, read, w5, w1, output_tokens)
    except BillingError as exc:
        raise UsageReportError(str(exc)) from exc


def usage_of(b: Buckets) -> Usage:
    return Usage(
        input_tokens=b.input_tokens,
        cache_creation_input_tokens=b.cache_creation_input_tokens,
        cache_read_input_tokens=b.cache_read_input_tokens,
        output_tokens=b.output_tokens,
        cache_creation=CacheCreation(
            ephemeral_5m_input_tokens=b.cache_write_5m_tokens,
            ephemeral_1h_input_tokens=b.cache_write_1h_tokens,
        ),
    )
