"""Static-shape decoding: preallocated KV caches, one fixed shape per step kind, CUDA graphs.

Why: at batch 1 a small target's decode step is a few hundred tiny kernels. Run eagerly through
Hugging Face with a growing DynamicCache, each costs tens of µs of host time and the GPU idles
(SmolLM2-135M on an H200: 65 ms per token end to end). Here every step of a kind has one
shape, so each kind is captured once in a CUDA graph and replayed with a single launch:

    target-only step   target forward over [1, 1] (+ argmax when greedy)
    draft step         drafter over ≤ B new context rows (padded to B) + the block [1, B]
    verify step        target forward over [1, B]           (+ the drafter's context layers)
    greedy step        draft + argmax + verify + agreement in one graph, one per block length
                       (a full block, and each shorter last block before max_new_tokens)

What varies between steps lives in device tensors, not in shapes: the position of the first
new token (`start`) and the number of real new context rows (`count`). Key/value caches hold
`capacity` positions; attention reads all of them and masks those past the current position,
so nothing is ever cropped: a rejected draft's keys stay in the cache, masked, until the next
verified tokens overwrite them.

The same functions run without graphs on CPU and for odd shapes (the prefill, a short last
block), so the fast CPU suite checks all of the logic; only capture and replay need a GPU.

`compile_draft` compiles the drafter's forward over a full block (torch.compile, inductor) before
the graphs holding it are captured: under a graph a draft step's time is set by its kernel count,
and inductor fuses most of them (a DFlash2 drafter's four convolutions a layer above all). The
first call compiles, one thread at a time; `eval` turns it on for CUDA (`--compile-draft`).

The target's forward over the caches is `target.static_cache.StaticTarget` (the layer walk of
target/walk.py); which targets it runs (the Llama/Qwen block, a hybrid's Gated DeltaNet layers in
a layout it knows, no sliding window shorter than the cache) is the walk's probe,
`target.probe.static_unsupported`: a target it refuses decodes through Hugging Face eagerly
instead. Captured steps are `capture.CapturedStep`.

Hybrid targets. A linear-attention layer's convolution window and recurrent state hold no
positions that masking could hide: a verify step must not leave them advanced by drafts the
target then rejects. The verify step leaves them as they were and keeps what its block computed
(each position's k, v, decay, β and the block's convolution inputs); once the accepted count is
known, `commit` advances them by exactly the kept tokens, from that record, without running the
layers' projections again (`target.linear_attention`). Why this design: re-running the kept
tokens (what the HF decoder does) costs a second target forward per rejected step; keeping a
state per block position costs B states per layer (~2 MB each at 9B-like shapes) written every
step. The commit is a few small products per layer, and its count is a device tensor, so the
greedy step stays one CUDA graph: draft, verify, agreement and commit, with no host round trip.
`keep` commits again only when it keeps fewer tokens than the graph did (a stop token, the cap),
from the states saved before the step, so running a commit twice is harmless; the T > 0 path
commits in `keep`, one captured step per block length. A step that advances the states in
place (the target-only step, the greedy step) names them in `restore`, so a capture's checking
replay starts from the states its warm-up started from.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..capture import CapturedStep, GraphPool
from ..core.drafter import DFlashDrafter, embed_block_tokens
from ..target.model import Target
from ..target.static_cache import StaticTarget, attention_bias, cache_capacity, grouped_attention

_COMPILE_LOCK = threading.Lock()  # compiles of drafters' block forwards, one at a time in the process
PREFILL_STEP = 64  # prompts are right-padded to a multiple of this: a few prefill shapes, each captured once


def static_capacity(tokens: int, block_size: int) -> int:
    """The static decoder's cache positions for `tokens` (prompt + new tokens) decoded in blocks
    of `block_size` (1: target-only): a verify block may reach B - 1 past the end. The one
    computation of the size `eval` decodes with and `doctor` judges the target at."""
    return cache_capacity(tokens + block_size)


def prefill_width(tokens: int, capacity: int) -> int:
    """The padded width a prompt of `tokens` is prefilled at (never past the cache)."""
    return min(-(-tokens // PREFILL_STEP) * PREFILL_STEP, capacity)


# ---------------------------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------------------------


class StaticDrafter:
    """`DFlashDrafter.draft` over a preallocated context cache: `step(features, count, start,
    block_ids)` appends the first `count` rows of `features` [1, R, n·hidden] as context
    positions start−count .. start−1, runs the block `block_ids` [1, L] anchored at `start`
    and returns float32 draft logits [L − 1, vocab] through the target's frozen head.

    The block's own keys/values go to cache slots start..start+L−1 too: the block then sees
    slots < start + L, i.e. all verified context and itself (bidirectional), in one attention
    call with one mask row. The next step's verified context overwrites those slots.

    Each layer projects the context rows and the block in one pass and writes them with one
    copy, so the two sets of slots must not meet: rows past `count` (padding) go past the block,
    to start+L+i, the last slot at most. Slots ≥ start + L are masked in this step and, as start
    only grows, written with verified context before any later step can see them; the last slot
    is never seen (the cache holds B more positions than a decode reaches)."""

    def __init__(self, drafter: DFlashDrafter, target: Target, capacity: int, compiled: bool = False):
        self.drafter, self.target = drafter, target
        config = drafter.config
        self.block_size = config.block_size
        # Compiled at the full block only: nearly every step has it, and one shape is one compile.
        # Inductor fuses the norms, rotations, convolutions and gates of the ~300–450 small kernels
        # of a draft step; under a CUDA graph their count, not their work, sets the step's time.
        # The class's function, not the bound method: a bound one would tie this object into a
        # cycle and keep its caches alive past their state's eviction (see StaticState).
        self.compiled_hidden = torch.compile(StaticDrafter.eager_hidden, dynamic=False) if compiled else None
        self.compile_done = False
        weight = drafter.fc.weight
        self.device = weight.device
        shape = (len(drafter.layers), 1, config.num_key_value_heads, capacity, config.head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=weight.dtype, device=self.device)
        self.key_positions = torch.arange(capacity, device=self.device)
        self.capacity = capacity
        self.scale = config.head_dim**-0.5

    def add_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Every layer's context keys/values of target features [1, R, n·hidden] at `positions` [R].
        A context position's keys depend only on its own feature row and position, so the prompt's
        are written in the prefill (`step` writes a step's new rows with its block's)."""
        drafter = self.drafter
        cos, sin = drafter.rope(positions[None])
        context = drafter.hidden_norm(drafter.fc(features.to(drafter.fc.weight.dtype)))  # the drafter may run in another dtype
        for i, layer in enumerate(drafter.layers):
            self._write(i, positions, *layer.self_attn.keys_values(context, cos, sin))

    def step(self, features: torch.Tensor, count: torch.Tensor, start: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        return self.head_logits(self.hidden(features, count, start, block_ids))

    # No gradient, whoever calls: traced with one, the compile builds the backward too (it failed
    # so on the CPU), and a call in the other grad mode than the first would compile again.
    @torch.no_grad()
    def hidden(self, features: torch.Tensor, count: torch.Tensor, start: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The drafter's final hidden states [L − 1, hidden] of draft positions 1..L−1 (see `step`):
        compiled for a full block when the state was made with `compile_draft`."""
        if self.compiled_hidden is None or block_ids.shape[1] != self.block_size:
            return self.eager_hidden(features, count, start, block_ids)
        if self.compile_done:
            return self.compiled_hidden(self, features, count, start, block_ids)
        # The first call compiles: one thread at a time (torch.compile is not thread-safe), and a
        # compiler that fails costs speed, not the decode.
        with _COMPILE_LOCK:
            try:
                hidden = self.compiled_hidden(self, features, count, start, block_ids)
            except Exception as error:  # noqa: BLE001 - any compiler failure: run eagerly
                warnings.warn(f"the drafter's block forward runs uncompiled: torch.compile failed: "
                              f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
                self.compiled_hidden = None
                return self.eager_hidden(features, count, start, block_ids)
        self.compile_done = True
        return hidden

    def eager_hidden(self, features: torch.Tensor, count: torch.Tensor, start: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        drafter, config = self.drafter, self.drafter.config
        length, rows = block_ids.shape[1], features.shape[1]
        row = torch.arange(rows, device=self.device)
        context_positions = torch.where(row < count, start - count + row, (start + length + row).clamp(max=self.capacity - 1))
        positions = torch.cat([context_positions, start + torch.arange(length, device=self.device)])  # context, then block
        dtype = drafter.fc.weight.dtype  # the drafter may run in another dtype than the target
        # In the drafter's dtype once here, not in each of the 2 × layers rotations (apply_rope casts).
        cos_all, sin_all = (t.to(dtype) for t in drafter.rope(positions[None]))
        cos, sin = cos_all[:, rows:], sin_all[:, rows:]
        context = drafter.hidden_norm(drafter.fc(features.to(dtype)))
        x = embed_block_tokens(block_ids, self.target.embed_weight, config.input_embedding_scale).to(dtype)
        visible = (self.key_positions < start + length)[None, None]
        bias = attention_bias(visible, config.num_attention_heads // config.num_key_value_heads, self.keys.dtype)
        for i, layer in enumerate(drafter.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            if layer.attention_conv is not None:  # DFlash2: the block's states convolved before attention
                h, finish_kernel = layer.attention_conv.prepare(h, length)
            self._write(i, positions, *attn.keys_values(torch.cat([context, h], dim=1), cos_all, sin_all))
            out = attn.o_proj(grouped_attention(attn.queries(h, cos, sin), self.keys[i], self.values[i], bias, self.scale))
            if layer.attention_conv is not None:
                out = layer.attention_conv.finish(out, finish_kernel, length)
            x = x + out
            x = x + layer.around(layer.mlp_conv, layer.mlp, layer.post_attention_layernorm(x), length)
        return drafter.norm(x)[0, 1:]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits through the target's frozen head (softcapped where the target caps)."""
        config = self.drafter.config
        head = self.target.head_weight
        logits = F.linear(hidden.to(head.dtype), head).float()
        if config.final_logit_softcapping:
            logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
        return logits

    def greedy_drafts(self, features: torch.Tensor, count: torch.Tensor, start: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The T = 0 drafts [L − 1]: the argmax, or a DFlash2 drafter's selector path from the anchor."""
        hidden = self.hidden(features, count, start, block_ids)
        logits = self.head_logits(hidden)
        selector = self.drafter.candidate_selector
        if selector is None:
            return logits.argmax(-1)
        return selector.select(hidden[None], logits[None], block_ids[:, 0], 0.0)[0][0]

    def _write(self, index: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys[index].index_copy_(2, positions, keys)
        self.values[index].index_copy_(2, positions, values)


# ---------------------------------------------------------------------------------------------
# The decoding state for one (target, drafter, capacity)
# ---------------------------------------------------------------------------------------------


class StaticState:
    """The caches and captured steps of one (target, drafter, capacity) for one thread.

    Captured steps (inputs are the device buffers below, filled by `StaticDecoder`):
        prefill(W)    target forward of `prompt_ids[:, :W]` (a prompt of `prompt_length` tokens,
                      right-padded to W), the drafter's context keys/values of all W positions
                      -> logits after the last real token [vocab]. One graph per padded width:
                      run eagerly, every new prompt length is a new shape (SmolLM2 on an H200:
                      69 ms at a length not seen before, 4.4 ms captured; the difference is
                      launches and per-shape set-up, not kernel time).
        next_token    target forward of `token`                        -> logits [1, vocab]
        next_greedy   the same, argmax included                         -> [0, token]
        draft         drafter over `new_features` (`count` real rows)   -> draft logits [B − 1, vocab]
        verify        target forward of `verify_ids`, with features     -> logits, features
        greedy(L)     draft + argmax + verify + agreement of an L-token block in one graph
                      -> [accepted, target choices × L]; it leaves the verified features in
                      `new_features` for the next step. One graph per block length: the blocks
                      before max_new_tokens shrink (as the reference's do), and an eager step
                      there costs as much as several captured ones. The first step after the
                      prefill runs it too, with no new context rows (`count` 0): the prompt's
                      context is in the drafter's cache already.
    """

    def __init__(self, target: Target, drafter: DFlashDrafter | None, capacity: int, compile_draft: bool = False):
        device = target.device
        self.capacity, self.device = capacity, device
        # Steps call the state through a weak proxy: a state that owned steps which owned it would
        # outlive its eviction (and hold its caches and graph pools) until a collector pass.
        me = weakref.proxy(self)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.target = StaticTarget(target, capacity, list(drafter.config.target_layer_ids) if drafter else None,
                                   pending_tokens=drafter.config.block_size if drafter else 0)
        # A hybrid's linear-attention states: a verify step leaves them pending until the kept
        # tokens are known (`commit`); steps that advance them restore them before their checking
        # replay (capture.CapturedStep). A dense target has none: () and False change nothing.
        self.hybrid = self.target.linear is not None
        states = self.target.state_tensors()
        self.kept = torch.ones(1, dtype=torch.long, device=device)  # block tokens a commit keeps
        self.commit_steps: dict[int, CapturedStep[None]] = {}
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.prompt_ids = torch.zeros(1, capacity, dtype=torch.long, device=device)
        self.prompt_length = torch.ones((), dtype=torch.long, device=device)
        self.prefill_steps: dict[int, CapturedStep[torch.Tensor]] = {}
        # The prefill graphs share one memory pool (one per width would hold a full forward's
        # activations each): a prefill's logits are read before any other prefill replays.
        self.prefill_pool = GraphPool() if device.type == "cuda" else None
        self.next_token = CapturedStep(lambda: me.target.single(me.token, me.start, features=False)[0], device, "target-only",
                                       restore=states)
        self.next_greedy = CapturedStep(lambda: me._next_greedy(), device, "target-only greedy", restore=states)
        self.drafter = None
        if drafter is not None:
            block = drafter.config.block_size
            self.drafter = StaticDrafter(drafter, target, capacity, compiled=compile_draft)
            self.block = torch.full((1, block), drafter.config.mask_token_id, dtype=torch.long, device=device)
            self.new_features = torch.zeros(1, block, drafter.fc.in_features, dtype=target.embed_weight.dtype, device=device)
            self.count = torch.zeros((), dtype=torch.long, device=device)
            self.bonus = torch.zeros(1, dtype=torch.long, device=device)
            self.draft = CapturedStep(
                lambda: me.drafter.step(me.new_features, me.count, me.start, me.block), device, "draft"
            )
            self.verify_ids = torch.zeros(1, block, dtype=torch.long, device=device)
            self.verify = CapturedStep(lambda: me.target.single(me.verify_ids, me.start, pending=me.hybrid), device, "verify")
            self.greedy_steps: dict[int, CapturedStep[torch.Tensor]] = {}

    def capture_all(self) -> None:
        """Capture every step shape now (each prefill width on CUDA, the full block and each
        shorter last block), so no capture lands inside a timed decode. A decode writes every
        cache slot it reads (prefill, verified context, its own block) before reading it."""
        if self.device.type == "cuda":  # elsewhere a prefill runs eagerly whatever its width: nothing to capture
            self.prompt_ids.zero_()
            self.prompt_length.fill_(1)
            for width in range(PREFILL_STEP, self.capacity + 1, PREFILL_STEP):
                self.prefill(width)()
        self.start.zero_()
        self.token.zero_()
        self.next_greedy()
        if self.drafter is not None:
            self.start.fill_(1)  # one context row, at position 0
            self.count.fill_(1)
            self.bonus.zero_()
            for length in range(2, self.block.shape[1] + 1):
                self.greedy(length)()

    def prefill(self, width: int) -> CapturedStep[torch.Tensor]:
        if width not in self.prefill_steps:
            me = weakref.proxy(self)  # not self: see __init__
            self.prefill_steps[width] = CapturedStep(lambda: me._prefill(width), self.device, f"{width}-token prefill",
                                                     pool=self.prefill_pool)
        return self.prefill_steps[width]

    def _prefill(self, width: int) -> torch.Tensor:
        # Padding past the prompt sits at positions ≥ its length: the prompt's own queries never
        # see it (causal), and later steps mask it until verified tokens overwrite it. A hybrid's
        # linear-attention states start from zero and take the prompt's real tokens only.
        logits, features = self.target.single(self.prompt_ids[:, :width], self.start.new_zeros(()),
                                              features=self.drafter is not None, logits_at=self.prompt_length - 1,
                                              fresh=True, lengths=self.prompt_length.view(1))
        if self.drafter is not None:
            self.drafter.add_context(features, torch.arange(width, device=self.device))
        return logits[0]

    def _next_greedy(self) -> torch.Tensor:
        token = self.target.single(self.token, self.start, features=False)[0].argmax(-1)
        return torch.cat([torch.zeros_like(token), token])

    def greedy(self, length: int) -> CapturedStep[torch.Tensor]:
        if length not in self.greedy_steps:
            me = weakref.proxy(self)  # not self: see __init__
            self.greedy_steps[length] = CapturedStep(
                lambda: me._greedy(length), self.device, f"greedy {length}-token block",
                restore=(self.new_features,) + self.target.state_tensors(),
            )
        return self.greedy_steps[length]

    def _greedy(self, length: int) -> torch.Tensor:
        block, ids = self.block[:, :length], self.verify_ids[:, :length]
        block[0, :1].copy_(self.bonus)
        drafts = self.drafter.greedy_drafts(self.new_features, self.count, self.start, block)
        ids[0, :1].copy_(self.bonus)
        ids[0, 1:].copy_(drafts)
        logits, features = self.target.single(ids, self.start, pending=self.hybrid)
        self.new_features[:, :length].copy_(features)  # the next step's context: its first `count` rows are kept
        result = agreement(ids, logits)
        if self.hybrid:  # the bonus and the accepted drafts, on the device: no host round trip
            self.target.commit((result[0] + 1).view(1), length)
        return result

    def commit(self, length: int) -> CapturedStep[None]:
        """Advance the linear-attention states by the first `kept` tokens of the pending
        `length`-token verify step (a hybrid target; reads the states saved before it, so
        running it again gives the same states)."""
        if length not in self.commit_steps:
            me = weakref.proxy(self)  # not self: see __init__
            self.commit_steps[length] = CapturedStep(lambda: me.target.commit(me.kept, length), self.device,
                                                     f"commit of a {length}-token block")
        return self.commit_steps[length]


def agreement(block: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[accepted, choice_0, ..., choice_{L−1}] for a verified block [1, L] and the target's
    logits [L, vocab]: choice_i is the target's own token after block position i, and the
    leading `accepted` drafts equal it, so the new tokens are choice[:accepted + 1]."""
    choice = logits.argmax(-1)
    accepted = (block[0, 1:] == choice[:-1]).long().cumprod(0).sum()
    return torch.cat([accepted.view(1), choice])


class _StateShelf:
    """The states cached for one module (a drafter; the target model for target-only decoding),
    kept in that module's __dict__: freed with it (module and states form a cycle the garbage
    collector reclaims; a global table would keep both alive), and never copied with it."""

    def __init__(self) -> None:
        self.states: dict[tuple, tuple[tuple[int, ...], StaticState]] = {}

    def __deepcopy__(self, memo: dict) -> "_StateShelf":
        return _StateShelf()

    def __reduce__(self):
        return (_StateShelf, ())


class _ThreadToken:
    """Held only by a threading.local, so it lives exactly as long as its thread; a weak
    reference to it names the thread (thread ids are reused) and fires when the thread ends."""

    def __init__(self) -> None:
        self.ref = weakref.ref(self, _drop_thread_states)


_SHELF = "_dflash_static_states"
_SHELVES: "weakref.WeakSet[_StateShelf]" = weakref.WeakSet()
_THREADS = threading.local()
_STATES_LOCK = threading.RLock()
_MAX_STATES = 8  # per module: each holds caches and graphs


def _drop_thread_states(thread: weakref.ref) -> None:
    """A thread ended: release its states everywhere."""
    with _STATES_LOCK:
        for shelf in list(_SHELVES):
            for key in [k for k in shelf.states if k[0] is thread]:
                del shelf.states[key]


def _thread_ref() -> weakref.ref:
    token = getattr(_THREADS, "token", None)
    if token is None:
        token = _THREADS.token = _ThreadToken()
    return token.ref


def static_state(target: Target, drafter: DFlashDrafter | None, capacity: int, compile_draft: bool = False) -> StaticState:
    """The cached state for this target, drafter, capacity and thread: graphs are captured once
    per capacity and reused by every later prompt (two threads never share caches).
    `compile_draft`: the drafter's block forward compiled before its graphs are captured.

    Lifetime: a state lives on its drafter (target-only states on the target model), so it goes
    when that module goes; it is released when its thread ends; at most `_MAX_STATES` per module
    (the oldest is dropped). A state holds its target model, so a target dropped while a drafter
    that decoded with it lives stays until that drafter goes."""
    owner = drafter if drafter is not None else target.model
    storage = _weight_storage(target.model, drafter)
    with _STATES_LOCK:
        shelf = vars(owner).get(_SHELF)
        if shelf is None:
            shelf = vars(owner)[_SHELF] = _StateShelf()
        _SHELVES.add(shelf)
        states = shelf.states
        key = (_thread_ref(), weakref.ref(target.model), capacity, compile_draft and drafter is not None)
        # Captured graphs read weights at fixed addresses: in-place updates (an optimizer step,
        # load_state_dict) are seen, a replaced tensor (`param.data = ...`) is not, so rebuild then.
        if key not in states or states[key][0] != storage:
            states.pop(key, None)
            if len(states) >= _MAX_STATES:  # bounded: drop the oldest
                states.pop(next(iter(states)))
            states[key] = (storage, StaticState(target, drafter, capacity, compile_draft))
        return states[key][1]


def _weight_storage(*modules: nn.Module | None) -> tuple[int, ...]:
    return tuple(p.data_ptr() for module in modules if module is not None for p in module.parameters())


class StaticDecoder:
    """The decode loop's operations (see `decode.loop.generate`) on a `StaticState`: fixed shapes go
    through the captured steps, odd ones (the prompt, a short last block, a first context longer
    than a block) run the same functions eagerly. Device scalars are set with fill kernels, so
    nothing here waits for the GPU; `greedy` returns host ints, its one transfer per step."""

    kind = "static"

    def __init__(self, state: StaticState, block_size: int):
        self.state, self.block_size = state, block_size
        # A hybrid's verify step not yet settled by `keep`: (its start, its length, the tokens the
        # step's graph already committed or None).
        self.pending: tuple[int, int, int | None] | None = None

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt through the target and, with a drafter, into the drafter's context cache
        (one captured step per padded width) -> (logits after the prompt, no new context rows:
        so the first step is a whole-step one too)."""
        state = self.state
        length = prompt.shape[1]
        self.pending = None
        state.prompt_ids[:, :length].copy_(prompt)
        state.prompt_length.fill_(length)
        logits = state.prefill(prefill_width(length, state.capacity))()
        return logits, (state.new_features[:, :0] if state.drafter is not None else None)

    def draft(self, features: torch.Tensor, start: int, bonus: torch.Tensor, length: int) -> torch.Tensor:
        state = self.state
        count = features.shape[1]
        state.start.fill_(start)
        state.count.fill_(count)
        if length == self.block_size and count <= self.block_size:
            if features.data_ptr() != state.new_features.data_ptr():
                state.new_features[:, :count].copy_(features)
            state.block[0, :1].copy_(bonus)
            return state.draft()
        block = state.block[:, :length].clone()
        block[0, :1].copy_(bonus)
        return state.drafter.step(features, state.count, state.start, block)

    def draft_hidden(self, features: torch.Tensor, start: int, bonus: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft` eagerly, returning the drafter's hidden states [length − 1, hidden] with the logits
        (what a DFlash2 drafter's selector needs)."""
        state = self.state
        state.start.fill_(start)
        state.count.fill_(features.shape[1])
        block = state.block[:, :length].clone()
        block[0, :1].copy_(bonus)
        hidden = state.drafter.hidden(features, state.count, state.start, block)
        return hidden, state.drafter.head_logits(hidden)

    def greedy_drafts(self, features: torch.Tensor, start: int, bonus: torch.Tensor, length: int) -> torch.Tensor:
        """The T = 0 drafts [length − 1] of a step taken by parts (see `greedy_by_parts`)."""
        selector = self.state.drafter.drafter.candidate_selector
        if selector is None:
            return self.draft(features, start, bonus, length).argmax(-1)
        hidden, logits = self.draft_hidden(features, start, bonus, length)
        return selector.select(hidden[None], logits[None], bonus, 0.0)[0][0]

    def verify(self, block: torch.Tensor, start: int, features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over `block` at `start`. A hybrid's linear-attention states are left
        pending when the block has several tokens (`keep` advances them by the kept ones)."""
        state = self.state
        state.start.fill_(start)
        length = block.shape[1]
        pending = state.hybrid and length > 1
        self.pending = (start, length, None) if pending else None
        if features and length == self.block_size:
            state.verify_ids.copy_(block)
            return state.verify()
        if not features and length == 1:
            state.token.copy_(block)
            return state.next_token(), None
        return state.target.single(block, state.start, features=features, pending=pending)

    def greedy(
        self, features: torch.Tensor | None, start: int, bonus: torch.Tensor, length: int
    ) -> tuple[list[int], torch.Tensor | None]:
        state = self.state
        if state.drafter is None and length == 1:
            state.start.fill_(start)
            state.token.copy_(bonus[None])
            self.pending = None
            return state.next_greedy().tolist(), None
        # One graph for the whole step when the new context rows are the last step's verified
        # ones (views of `new_features`) or none (the first step: the prefill wrote the prompt's);
        # other features (a caller's own) go by parts.
        if features.shape[1] == 0 or features.data_ptr() == state.new_features.data_ptr():
            state.start.fill_(start)
            state.count.fill_(features.shape[1])
            state.bonus.copy_(bonus)
            host = state.greedy(length)().tolist()
            # The graph committed the bonus and the accepted drafts; `keep` may keep fewer.
            self.pending = (start, length, host[0] + 1) if state.hybrid else None
            return host, state.new_features
        host, step_features = greedy_by_parts(self, features, start, bonus, length)
        state.new_features[:, :length].copy_(step_features)
        return host, state.new_features

    def keep(self, length: int) -> None:
        """Nothing to crop: positions ≥ length are masked until verified tokens overwrite them.
        A hybrid's linear-attention states after a verify step are advanced by exactly the kept
        tokens (those before `length`), unless the step's graph committed that many already."""
        if self.pending is None:
            return
        start, verified, committed = self.pending
        self.pending = None
        if length - start != committed:
            self.state.kept.fill_(length - start)
            self.state.commit(verified)()

    @torch.no_grad()
    def prepare(self) -> None:
        """Capture every greedy step's graph before anything is timed (see StaticState.capture_all)."""
        self.state.capture_all()


def greedy_by_parts(decoder, features, start: int, bonus: torch.Tensor, length: int) -> tuple[list[int], torch.Tensor | None]:
    """A greedy step from a decoder's `greedy_drafts` and `verify`: drafts, verify, agreement."""
    if length > 1:
        drafts = decoder.greedy_drafts(features, start, bonus, length)
        block = torch.cat([bonus, drafts])[None]
    else:
        block = bonus[None]
    logits, step_features = decoder.verify(block, start, features=length > 1)
    return agreement(block, logits).tolist(), step_features
