"""In-process answers from the JAX target (`specjax.eval.generate.generate`: batched, KV cache).

Prompts are rendered with the chat template (generation prompt appended) and tokenized like the
training pipeline does (no extra special tokens: templates write their own BOS). End of turn =
the tokenizer's eos token plus every `eos_token_id` of the target's generation_config.json."""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence

from specjax.data.chat import ChatTemplateUnusable, render_chat, resolve_chat_template
from specjax.regen.common import LOGGER_NAME, Answer, Item, RegenerateError, compose_answer, split_reasoning

__all__ = ["JaxBackend", "eos_token_ids", "generation_defaults"]

log = logging.getLogger(LOGGER_NAME)


def _generation_config(target_dir: str) -> dict:
    path = os.path.join(target_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else {}
    except (OSError, json.JSONDecodeError) as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return {}


def _as_ids(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v if x is not None]
    return [int(v)]


def eos_token_ids(tokenizer, target_dir: str) -> tuple[int, ...]:
    ids = _as_ids(getattr(tokenizer, "eos_token_id", None)) + _as_ids(_generation_config(target_dir).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))  # ordered, unique


def generation_defaults(target_dir: str) -> dict:
    """Sampling defaults from generation_config.json: temperature (0 when do_sample is false or
    absent), top_p, max_new_tokens -- only the keys it sets."""
    g = _generation_config(target_dir)
    out = {}
    if "do_sample" in g or "temperature" in g:
        out["temperature"] = float(g.get("temperature", 1.0)) if g.get("do_sample") else 0.0
    if g.get("do_sample") and "top_p" in g:
        out["top_p"] = float(g["top_p"])
    if isinstance(g.get("max_new_tokens"), int):
        out["max_new_tokens"] = g["max_new_tokens"]
    return out


LONG_PROMPTS = ("skip", "drop_oldest_turns")


class JaxBackend:
    name = "jax"

    def __init__(
        self,
        target,
        tokenizer,
        *,
        chat_template: str | None,
        eos_ids: Sequence[int],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        max_prompt_tokens: int,
        batch_size: int,
        seed: int,
        keep_reasoning: bool,
        generate_fn: Callable | None = None,
        long_prompts: str = "skip",
        segment_steps: int = 16,
        template_limits=None,
        template_variables=None,
    ):
        if max_new_tokens <= 0:
            raise RegenerateError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if max_prompt_tokens <= 0:
            raise RegenerateError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
        if batch_size <= 0:
            raise RegenerateError(f"batch_size must be positive, got {batch_size}")
        if long_prompts not in LONG_PROMPTS:
            raise RegenerateError(f"long_prompts must be one of {LONG_PROMPTS}, got {long_prompts!r}")
        if not eos_ids:
            raise RegenerateError("no end-of-turn token: the tokenizer has no eos_token and the target folder's "
                                  "generation_config.json no eos_token_id; add one of them")
        self.target = target
        self.tokenizer = tokenizer
        try:
            # every prompt is rendered under template_limits (a TemplateLimits; default: its defaults)
            self.template = resolve_chat_template(tokenizer, chat_template, template_limits, template_variables)
        except ValueError as e:
            raise RegenerateError(str(e)) from None
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_prompt_tokens = int(max_prompt_tokens)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.keep_reasoning = keep_reasoning
        self.long_prompts = long_prompts
        self.segment_steps = int(segment_steps)
        # an injected generate function (tests) also answers `run_flows`, in rounds; else continuous batching
        self.injected = generate_fn is not None
        if generate_fn is None:
            from specjax.eval.generate import generate as generate_fn  # the batched KV-cache decoder
        self.generate_fn = generate_fn

    def encode(self, prompt: Sequence[dict]) -> list[int]:
        text = render_chat(self.tokenizer, self.template, list(prompt), add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def fit_prompt(self, prompt: Sequence[dict]) -> tuple[list[int], tuple | None] | None:
        """Token ids of the prompt and, when older turns had to go, the shortened prompt; None when
        it cannot fit max_prompt_tokens. long_prompts="drop_oldest_turns" drops whole exchanges from
        the start (a leading system message stays), so what is left still begins with a user turn;
        the last user turn is never cut. ShareGPT prompts carry the whole earlier conversation, so
        "skip" alone loses most long conversations (63% at 1024 tokens on the GPU recipe)."""
        ids = self.encode(prompt)
        if len(ids) <= self.max_prompt_tokens:
            return ids, None
        if self.long_prompts == "skip":
            return None
        head = [m for m in prompt[:1] if m["role"] == "system"]
        rest = list(prompt[len(head):])
        while True:
            nxt = next((j for j in range(1, len(rest)) if rest[j]["role"] == "user"), None)
            if nxt is None:  # only the turn to answer is left, and it is too long
                return None
            rest = rest[nxt:]
            ids = self.encode(head + rest)
            if len(ids) <= self.max_prompt_tokens:
                return ids, tuple(head + rest)

    def answer(self, items: Sequence[Item]) -> list[Answer]:
        out: list[Answer | None] = [None] * len(items)
        used: dict[int, tuple | None] = {}  # the shortened prompt, where older turns were dropped
        todo: list[tuple[int, list[int]]] = []
        for i, it in enumerate(items):
            fitted = self._fit_or_answer(it)
            if isinstance(fitted, Answer):
                out[i] = fitted
            else:
                ids, used[i] = fitted
                todo.append((i, ids))
        if todo:
            # one seed per shard (from its first row): a resumed shard draws what it drew before,
            # and shards do not repeat one another's samples
            seed = self.seed + 1_000_003 * items[0].source_index
            gen = self.generate_fn(
                self.target, [ids for _, ids in todo], max_new_tokens=self.max_new_tokens,
                temperature=self.temperature, top_p=self.top_p, eos_token_ids=self.eos_ids,
                seed=seed % 2**31, batch_size=self.batch_size,
            )
            if len(gen) != len(todo):
                raise RuntimeError(f"generate returned {len(gen)} answers for {len(todo)} prompts")
            for (i, _), new in zip(todo, gen):
                out[i] = self.answer_from_tokens(new, used.get(i))
        return out  # type: ignore[return-value]

    def answer_from_tokens(self, new, shortened: tuple | None) -> Answer:
        """The Answer for the target's new tokens (EOS already cut)."""
        new = [int(t) for t in new]
        truncated = len(new) >= self.max_new_tokens
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        reasoning, answer = split_reasoning(text)
        if not answer:
            return Answer(None, "empty answer", len(new), truncated)
        return Answer(compose_answer(reasoning, answer, self.keep_reasoning), None, len(new), truncated,
                      prompt=shortened)

    def _fit_or_answer(self, item: Item) -> tuple[list[int], tuple | None] | Answer:
        """(prompt ids, shortened prompt) to generate from, or the Answer that skips this item."""
        try:
            fitted = self.fit_prompt(item.prompt)
        except ChatTemplateUnusable as e:  # jinja2 missing, a template that does not compile or runs past a
            # limit: not this row's problem, and the run stops (specjax.regenerate makes it one line)
            raise type(e)(f"{e} (first met rendering the conversation of input row {item.source_index + 1})") from e
        except Exception as e:  # noqa: BLE001 - a template that rejects this conversation
            log.debug("row %d: chat template error: %s", item.source_index, e)
            return Answer(None, "chat template error")
        return Answer(None, "prompt longer than max_prompt_tokens") if fitted is None else fitted

    def run_flows(self, flows, on_finished) -> dict:
        """Answer conversations (``ConversationFlow``) turn by turn with continuous batching: each
        answer that ends queues its conversation's next turn at once, so no conversation waits for a
        round of others. ``flows`` yields (key, flow, priority), lazily; ``on_finished(key, flow)`` is
        called when a conversation has ended. Returns the engine's counters."""
        from specjax.eval.continuous import ContinuousGenerator, Request

        def requests(key, flow, priority):
            """The flow's next request, answering at once the turns that cannot be sent."""
            while (item := flow.next_item()) is not None:
                fitted = self._fit_or_answer(item)
                if isinstance(fitted, Answer):
                    flow.record(item, fitted)
                    continue
                ids, shortened = fitted
                sample_id = (item.source_index * 1_000_003 + flow.turn) % 2**31
                return [Request((key, flow, priority, item, shortened), tuple(ids), priority, sample_id)]
            on_finished(key, flow)
            return []

        def on_done(rkey, tokens):
            key, flow, priority, item, shortened = rkey
            flow.record(item, self.answer_from_tokens(tokens, shortened))
            return requests(key, flow, priority)

        source = (r for key, flow, priority in flows for r in requests(key, flow, priority))
        if self.injected:
            return _run_in_rounds(self, source, on_done)
        engine = ContinuousGenerator(
            self.target, batch_size=self.batch_size, max_prompt_tokens=self.max_prompt_tokens,
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            eos_token_ids=self.eos_ids, seed=self.seed, segment_steps=self.segment_steps)
        engine.run(source, on_done)
        return dict(engine.stats)


def _run_in_rounds(backend: JaxBackend, source, on_done) -> dict:
    """``run_flows`` through an injected ``generate(target, prompts, **kw)``: every waiting request in
    one call per round (the tests' fake generators)."""
    waiting, rounds = list(source), 0
    while waiting:
        outs = backend.generate_fn(
            backend.target, [list(r.ids) for r in waiting], max_new_tokens=backend.max_new_tokens,
            temperature=backend.temperature, top_p=backend.top_p, eos_token_ids=backend.eos_ids,
            seed=backend.seed, batch_size=backend.batch_size)
        if len(outs) != len(waiting):
            raise RuntimeError(f"generate returned {len(outs)} answers for {len(waiting)} prompts")
        waiting = [nxt for r, new in zip(waiting, outs) for nxt in on_done(r.key, list(new))]
        rounds += 1
    return {"rounds": rounds}
