"""The dynamic generator: many jobs share one model and one paged cache, advanced together.

Each `iterate()`:
  1. admits waiting jobs while the batch has room and the cache has pages for their prompts (reusing any
     cached prefix pages; a job whose prefix is being written by a running job waits for it). Pages are
     taken as sequences grow, not for the whole `max_new_tokens` up front; when the cache runs out, the
     newest job is preempted: it gives its pages back (its full pages stay cached for reuse), keeps its
     tokens and sampler state, and is queued first to be prefilled again and go on where it stopped. The
     oldest job can always go on (validate() checks that every job alone fits the cache), so all finish,
  2. proposes draft tokens for decoding jobs (draft model or n-gram lookup) when speculation is on,
  3. runs ONE forward pass over a packed batch: the next prompt chunk of jobs in prefill (up to
     `max_chunk_size` prompt tokens in all) and the next token (plus drafts) of every decoding job,
  4. samples, applies stop conditions / banned strings / constraints, and returns one Event per job
     that produced something; finished jobs release their pages at once.

    gen = Generator(model, PagedCache(model, max_tokens=8192), tokenizer)
    print(gen.generate("Once upon a time", max_new_tokens=50, sampler=SamplerSettings.greedy()))
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque

import numpy as np
import torch

from exl.cache.paged import PagedCache, PagedContext
from exl.errors import ExlError
from exl.generator.job import Event, Job
from exl.generator.sampling import SamplerSettings, SamplerState, process, sample
from exl.generator.speculative import NgramIndex, accept_draft
from exl.tokenizer import StreamDecoder


class _Run:
    """A job's state while the generator holds it."""

    def __init__(self, job: Job, gen: "Generator"):
        self.job = job
        n = len(job.input_ids)
        self.buf = np.zeros(n + job.max_new_tokens + 1, dtype=np.int64)
        self.buf[:n] = job.input_ids
        self.n = n  # tokens in the sequence (prompt + generated)
        self.prompt_len = n
        self.order = next(gen._arrivals)  # arrival: the newest running job is preempted first
        self.prefill_end = n  # tokens to prefill: the prompt, or after a preemption the sequence minus its last
        self.resumed = False  # prefilling again after a preemption (no token is sampled at the end)
        self.preemptions = 0
        self.table = self.draft_table = None
        self.seed = job.seed if job.seed is not None else random.SystemRandom().randrange(2**63)
        job.seed = self.seed
        self.rng = torch.Generator().manual_seed(self.seed)
        self.draft_rng = torch.Generator().manual_seed(self.seed ^ 0x5DEECE66D)
        self.sampler = SamplerState(job.sampler, gen.vocab, gen.tokenizer)
        self.greedy = job.sampler.is_greedy
        sp = job.sampler  # greedy with nothing that changes logits first: the token is the row's argmax
        self.plain_greedy = self.greedy and not (sp.logit_bias or sp.banned_tokens or sp.dry_multiplier > 0
                                                 or sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0
                                                 or sp.presence_penalty != 0.0)
        self.stop_tokens = set(job.stop_tokens)
        if not job.ignore_eos and gen.tokenizer is not None:
            self.stop_tokens |= set(gen.tokenizer.eos_token_ids)
        self.stop_mask = None
        if job.min_new_tokens and self.stop_tokens:
            self.stop_mask = torch.ones(gen.vocab, dtype=torch.bool)
            self.stop_mask[[t for t in self.stop_tokens if t < gen.vocab]] = False
        self.decoder = StreamDecoder(gen.tokenizer, skip_special=not job.decode_special_tokens) if gen.tokenizer else None
        self.constraint = job.constraint.start() if job.constraint is not None else None
        self.ngram = NgramIndex() if gen.ngram_draft else None
        self.held_text = ""  # decoded text not emitted yet (could still start a stop / banned string)
        self.held: list[list] = []  # [token, offset in held_text, raw logits or None] per token not yet emitted
        self.bans: dict[int, set[int]] = {}  # position -> tokens banned there (banned-string rewinds)
        self.event: Event | None = None
        self.t_enqueue = time.perf_counter()
        self.t_first = self.t_end = None
        self.cached_tokens = 0
        self.drafted = self.accepted = 0
        self.rewinds = 0

    @property
    def ids(self) -> np.ndarray:
        return self.buf[: self.n]

    @property
    def last(self) -> int:
        return int(self.buf[self.n - 1])

    def ev(self) -> Event:
        if self.event is None:
            j = self.job
            self.event = Event(job=j, identifier=j.identifier, logprobs=[] if j.return_logprobs else None,
                               top_logprobs=[] if j.return_top_tokens else None)
        return self.event


class Generator:
    """Runs many Jobs on one model and PagedCache (see module docstring).

    max_batch_size: jobs running at once. max_chunk_size: prompt tokens processed per iteration (all jobs).
    draft_model / draft_cache: speculative decoding with a smaller model (the cache is made if not given);
    ngram_draft: speculative decoding by n-gram prompt lookup instead. num_draft_tokens: tokens proposed per step.
    """

    def __init__(self, model, cache: PagedCache, tokenizer, max_batch_size: int = 16, max_chunk_size: int = 512,
                 draft_model=None, draft_cache: PagedCache | None = None, num_draft_tokens: int = 4,
                 ngram_draft: bool = False):
        if not isinstance(cache, PagedCache):
            raise TypeError(f"Generator needs an exl.cache.paged.PagedCache, got {type(cache).__name__}")
        if cache.config.num_layers != model.config.num_layers or cache.config.head_dim != model.config.head_dim:
            raise ValueError("Generator: the cache was built for a different model (layer count / head size differ)")
        if max_batch_size < 1 or max_chunk_size < 1 or num_draft_tokens < 1:
            raise ValueError("Generator: max_batch_size, max_chunk_size and num_draft_tokens must be >= 1")
        if draft_model is not None and ngram_draft:
            raise ValueError("Generator: use either a draft model or n-gram drafting, not both")
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.max_batch_size, self.max_chunk_size = int(max_batch_size), int(max_chunk_size)
        vocab = model.config.vocab_size
        if tokenizer is not None:
            vocab = min(vocab, tokenizer.vocab_size)
        self.vocab = vocab
        self.draft_model = draft_model
        if draft_model is not None:
            if draft_model.config.vocab_size < vocab:
                raise ValueError(f"Generator: the draft model's vocabulary ({draft_model.config.vocab_size}) is smaller "
                                 f"than the target's ({vocab}); it must share the tokenizer")
            if draft_cache is None:
                draft_cache = PagedCache(draft_model, num_pages=cache.num_pages, page_size=cache.page_size)
        self.draft_cache = draft_cache
        self.ngram_draft = bool(ngram_draft)
        self.num_draft_tokens = int(num_draft_tokens)
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self._arrivals = itertools.count()
        self._backlog: list[Event] = []
        self._finished_now: list[Job] = []
        self.stats = {"forward_passes": 0, "drafted": 0, "accepted": 0, "prefill_tokens": 0, "decode_steps": 0,
                      "preemptions": 0}
        # Called once per forward pass of the target model as its long GIL-free kernel call starts (or after the pass):
        # the asyncio front end hands the previous step's events to its delivery thread there (AttentionContext.launching).
        self.on_launch = None

    # -- public API -----------------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_preempted(self) -> int:
        """Waiting jobs that ran before and were preempted (they go on when pages are free again)."""
        return sum(1 for j in list(self.waiting) if j._run.preemptions)  # list(): a snapshot (other threads read)

    @property
    def speculative(self) -> bool:
        return self.draft_model is not None or self.ngram_draft

    def validate(self, job: Job) -> None:
        """Raise a clear error if the job can never run here (bad token ids, longer than the whole cache...)."""
        if not isinstance(job, Job):
            raise TypeError(f"expected a Job, got {type(job).__name__}")
        if job.status != "new":
            raise ValueError(f"{job} was already enqueued; make a new Job")
        limit = self.model.config.vocab_size
        bad = [t for t in job.input_ids if not 0 <= t < limit]
        if bad:
            raise ValueError(f"{job}: token ids {bad[:5]} are outside the model's vocabulary [0, {limit})")
        total = _stored_tokens(job)
        self.cache.check_fits(total, what=f"{job} (prompt {len(job.input_ids)} + max_new_tokens {job.max_new_tokens})")
        if self.draft_cache is not None:
            self.draft_cache.check_fits(total, what=f"{job} in the draft cache")
        if job.constraint is not None and self.tokenizer is None:
            raise ValueError("a constraint needs the Generator to have a tokenizer")
        if (job.stop_strings or job.banned_strings) and self.tokenizer is None:
            raise ValueError("stop / banned strings need the Generator to have a tokenizer")

    def enqueue(self, job: Job | list[Job]) -> None:
        """Queue one or more jobs; they start in a later iterate() as batch slots and cache pages allow."""
        jobs = job if isinstance(job, (list, tuple)) else [job]
        for j in jobs:
            self.validate(j)
        for j in jobs:
            j._run = _Run(j, self)
            j.status = "waiting"
            self.waiting.append(j)

    def cancel(self, job: Job) -> None:
        """Stop a waiting or running job now and free its pages; its final event (eos_reason "cancelled") comes
        from the next iterate()."""
        if job.status in ("new", "done"):
            return
        if job in self.waiting:
            self.waiting.remove(job)
        self._finish(job, "cancelled", flush=False)
        self._backlog.append(self._take_event(job))

    def cancel_all(self) -> None:
        for j in list(self.running) + list(self.waiting):
            self.cancel(j)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._backlog)

    @torch.inference_mode()
    def iterate(self) -> list[Event]:
        """Advance every running job by one step (see module docstring). Returns this step's events."""
        events, self._backlog = self._backlog, []
        self._finished_now = []
        self._admit()
        if self.running:
            self._step()
        for j in self.running + self._finished_now:
            ev = j._run.event
            if ev is not None and (ev.text or ev.token_ids or ev.eos):
                events.append(self._take_event(j))
        self._finished_now = []
        return events

    def generate(self, prompt, max_new_tokens: int = 256, sampler: SamplerSettings | None = None, seed=None,
                 stop_conditions=None, add_bos: bool | None = None, encode_special: bool = True,
                 completion_only: bool = True, return_events: bool = False, **job_kwargs):
        """Generate for one prompt (str or token ids) or a list of prompts, all in one batch, and return the text
        (a list for a list). With completion_only=False the prompt text is included. return_events: also return
        each job's final Event (timings, token counts). Other jobs' events are kept for the next iterate()."""
        single = isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int)) \
            or isinstance(prompt, torch.Tensor)
        prompts = [prompt] if single else list(prompt)
        jobs = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("generate() with text prompts needs a tokenizer")
                ids = self.tokenizer.encode(p, add_bos=add_bos, special=encode_special)
            else:
                ids = p
            jobs.append(Job(ids, max_new_tokens=max_new_tokens, sampler=sampler,
                            seed=None if seed is None else seed + i, stop_conditions=stop_conditions,
                            identifier=("generate", i), **job_kwargs))
        self.enqueue(jobs)
        texts = {id(j): [] for j in jobs}
        finals = {}
        mine = set(texts)
        others = []
        while len(finals) < len(jobs):
            for e in self.iterate():
                if id(e.job) in mine:
                    texts[id(e.job)].append(e.text)
                    if e.eos:
                        finals[id(e.job)] = e
                else:
                    others.append(e)
        self._backlog = others + self._backlog
        out = []
        for p, j in zip(prompts, jobs):
            text = "".join(texts[id(j)])
            if not completion_only:
                text = (p if isinstance(p, str) else self.tokenizer.decode(j.input_ids)) + text
            out.append(text)
        result = out[0] if single else out
        if return_events:
            return result, (finals[id(jobs[0])] if single else [finals[id(j)] for j in jobs])
        return result

    # -- scheduling -----------------------------------------------------------------------------------------------

    def _admit(self) -> None:
        blocked = []
        while self.waiting and len(self.running) < self.max_batch_size:
            job = self.waiting.popleft()
            run = job._run
            ids = run.ids[: run.prefill_end].tolist()
            if self.cache.pending_prefix(ids):
                blocked.append(job)  # a running job is writing pages this prompt can reuse: wait for them
                continue
            # room for the prompt and the first step after it (none when the prefill's token is the last); more
            # as it grows. Never more than validate() checked, or a job alone in the cache could wait forever.
            first = min(run.prefill_end + 1, max(_stored_tokens(job), run.prefill_end))
            headroom = min(len(self.running), max(1, self.cache.num_pages // 8))  # room for running jobs to grow:
            if self.cache.pages_available < self.cache.pages_for(first) + headroom:  # no admit-preempt churn
                self.waiting.appendleft(job)
                break
            table = self.cache.open(ids, first)
            if table is None:
                self.waiting.appendleft(job)
                break
            if self.draft_cache is not None:
                dtable = self.draft_cache.open(ids, first, announce=False)
                if dtable is None:
                    self.cache.close(table, share=False)
                    self.waiting.appendleft(job)
                    break
                run.draft_table = dtable
            run.table = table
            if not run.resumed:
                run.cached_tokens = table.length
            job.status = "prefill"
            self.running.append(job)
        for job in reversed(blocked):
            self.waiting.appendleft(job)

    def _step(self) -> None:
        chunks = self._make_room()
        prefill = [j for j in self.running if j.status == "prefill"]
        decode = [j for j in self.running if j.status == "decode"]
        drafts = self._propose(decode) if self.speculative else {}
        segments = []  # (job, token ids, kind)
        for j in decode:
            segments.append((j, [j._run.last] + drafts.get(j, ([], None))[0], "decode"))
        for j in prefill:
            n = chunks.get(j, 0)
            if n > 0:
                start = j._run.table.length
                segments.append((j, j._run.ids[start : start + n].tolist(), "prefill"))
        if not segments:
            return
        logits, best = self._forward(segments)
        for (j, toks, kind), lg, top in zip(segments, logits, best):
            try:
                self._consume(j, toks, kind, lg, drafts, top)
            except Exception as e:  # noqa: BLE001 - a per-job failure (e.g. a constraint) ends only that job
                self._fail(j, e)
            if j.status == "done":
                self._finished_now.append(j)

    def _make_room(self) -> dict:
        """Reserve the pages this step needs, oldest job first: a decoding job's next token (and drafts), a
        prefilling job's next chunk (the chunk budget also goes oldest first). When the cache is full, the
        newest running job is preempted until the pages are there (or the job itself was the newest).
        Returns each prefilling job's chunk size."""
        budget, chunks = self.max_chunk_size, {}
        k = self.num_draft_tokens if self.speculative else 0
        for j in sorted(self.running, key=lambda j: j._run.order):
            if j not in self.running:  # preempted for an older job
                continue
            run = j._run
            total = _stored_tokens(j)
            if j.status == "decode":
                want, draft_want = min(run.table.length + 1 + k, total), min(run.n + k, total)
            else:
                n = min(run.prefill_end - run.table.length, budget)
                if n <= 0:
                    continue
                want, draft_want = run.table.length + n, 0
            while not (self.cache.reserve(run.table, want) and (
                    run.draft_table is None or self.draft_cache.reserve(run.draft_table, draft_want))):
                victim = max(self.running, key=lambda v: v._run.order)
                self._preempt(victim)
                if victim is j:
                    break
            else:
                if j.status == "prefill":
                    chunks[j] = n
                    budget -= n
        return chunks

    def _preempt(self, job: Job) -> None:
        """Take a running job off the cache: its pages go back (full ones stay cached, so resuming reuses what is
        not evicted meanwhile), its tokens and state stay; it waits first in line to be prefilled again."""
        run = job._run
        self.cache.close(run.table, share=True)
        if run.draft_table is not None:
            self.draft_cache.close(run.draft_table, share=True)
        run.table = run.draft_table = None
        self.running.remove(job)
        if job.status == "decode":  # the last token is not in the cache yet: it is fed by the next decode step
            run.prefill_end, run.resumed = run.n - 1, True
        job.status = "waiting"
        run.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(job)

    def _consume(self, j: Job, toks: list[int], kind: str, lg, drafts: dict, top=None) -> None:
        """Take one segment's forward-pass results: commit its K/V, sample (and verify drafts). top: each logits
        row's argmax where its largest logit is finite (else None), for plain greedy jobs."""
        run = j._run
        if kind == "prefill":
            self.cache.commit(run.table, toks, share=True)
            self.stats["prefill_tokens"] += len(toks)
            if run.table.length == run.prefill_end:
                j.status = "decode"
                if run.resumed:  # back where it was preempted: the next step feeds its last token
                    run.resumed = False
                    return
                run.t_first = time.perf_counter()
                self._advance(j, lg[-1], top[-1] if top else None)
        else:
            self.stats["decode_steps"] += 1  # one per job per step (plus its drafts, if any)
            d, q = drafts.get(j, ([], None))
            if d:
                self._verify(j, toks, lg, q)
            else:
                self.cache.commit(run.table, toks, share=False)
                self._advance(j, lg[-1], top[-1] if top else None)

    def _forward(self, segments) -> tuple[list, list]:
        """One packed forward pass; returns per segment the logits rows it needs ([n, V]) or None, and the argmax of
        each of those rows over the vocabulary (None where the row's maximum is not finite: NaN or inf)."""
        cache = self.cache
        for j, toks, _ in segments:
            cache.extend(j._run.table, len(toks))
        ctx = PagedContext(cache, [(j._run.table, len(toks)) for j, toks, _ in segments])
        ctx.on_launch = self.on_launch
        flat = [t for _, toks, _ in segments for t in toks]
        ids = torch.tensor([flat], dtype=torch.long, device=cache.device)
        h = self.model(ids, ctx=ctx, return_hidden=True)
        ctx.launching()
        self.stats["forward_passes"] += 1
        rows, spans, offset = [], [], 0
        for j, toks, kind in segments:
            n = len(toks)
            if kind == "prefill":
                if j._run.table.length + n == j._run.prefill_end and not j._run.resumed:
                    spans.append((len(rows), 1))
                    rows.append(offset + n - 1)
                else:
                    spans.append(None)
            else:
                spans.append((len(rows), n))
                rows.extend(range(offset, offset + n))
            offset += n
        out, best = [None] * len(segments), [None] * len(segments)
        if rows:
            hr = h[0] if len(rows) == h.shape[1] else h[0, torch.tensor(rows, device=h.device)]  # (decode: every row)
            lg = self.model.logits(hr[None])[0].cpu()  # sampled on the CPU
            top = None
            if any(j._run.plain_greedy for j, _, _ in segments):
                # One argmax over every row, for the plain greedy jobs (ties go to the first index, as in `process`).
                vals, idx = lg[:, : self.vocab].max(-1)
                top = [t if ok else None for t, ok in zip(idx.tolist(), torch.isfinite(vals).tolist())]
            for i, sp in enumerate(spans):
                if sp is not None:
                    out[i] = lg[sp[0] : sp[0] + sp[1]]
                    best[i] = top and top[sp[0] : sp[0] + sp[1]]
        return out, best

    # -- speculative decoding -------------------------------------------------------------------------------------

    def _propose(self, decode: list[Job]) -> dict:
        """Draft tokens (and draft distributions, None for n-gram) for jobs that can speculate."""
        jobs = []
        for j in decode:
            run = j._run
            k = min(self.num_draft_tokens, j.max_new_tokens - len(j.generated) - 1)
            if run.constraint is None and k > 0:
                jobs.append((j, k))
        if not jobs:
            return {}
        if self.ngram_draft:
            out = {}
            for j, k in jobs:
                d = j._run.ngram.propose(j._run.ids, k)
                if d:
                    out[j] = (d, None)
            return out
        return self._draft_model_propose(jobs)

    def _draft_model_propose(self, jobs) -> dict:
        dc = self.draft_cache
        drafts = {j: [] for j, _ in jobs}
        probs = {j: [] for j, _ in jobs}
        kmax = max(k for _, k in jobs)
        for step in range(kmax):
            active = [(j, k) for j, k in jobs if k > step]
            segs = []
            for j, _ in active:
                run = j._run
                if step == 0:  # catch up: every token the draft cache has not seen yet
                    toks = run.ids[run.draft_table.length :].tolist()
                else:
                    toks = [drafts[j][-1]]
                segs.append((j, toks))
            for j, toks in segs:
                dc.extend(j._run.draft_table, len(toks))
            ctx = PagedContext(dc, [(j._run.draft_table, len(toks)) for j, toks in segs])
            flat = [t for _, toks in segs for t in toks]
            h = self.draft_model(torch.tensor([flat], device=dc.device), ctx=ctx, return_hidden=True)
            ends = np.cumsum([len(t) for _, t in segs]) - 1
            lg = self.draft_model.logits(h[0, torch.tensor(ends, device=h.device)][None])[0].cpu()
            for (j, toks), row in zip(segs, lg):
                run = j._run
                dc.commit(run.draft_table, toks, share=False)
                context = np.concatenate([run.ids, np.asarray(drafts[j], dtype=np.int64)])
                q = process(row, run.sampler, context, run.draft_rng)
                t = sample(q, run.greedy, run.draft_rng)
                drafts[j].append(t)
                probs[j].append(q)
        return {j: (drafts[j], probs[j]) for j, _ in jobs}

    def _verify(self, job: Job, toks: list[int], logits: torch.Tensor, q_list) -> None:
        """Accept a prefix of the drafts (toks[1:]) against the target logits rows, then commit."""
        run = job._run
        drafts = toks[1:]
        self.stats["drafted"] += len(drafts)
        run.drafted += len(drafts)
        rewinds = run.rewinds
        for i, d in enumerate(drafts):
            p = self._distribution(job, logits[i])
            q = None if q_list is None else q_list[i]
            repl = accept_draft(p, q, d, run.greedy, run.rng)
            token = d if repl is None else repl
            if repl is None:
                self.stats["accepted"] += 1
                run.accepted += 1
            self._take(job, token, logits[i])
            if job.status == "done" or repl is not None or run.rewinds != rewinds:
                break
        else:
            if job.status != "done":
                self._take(job, sample(self._distribution(job, logits[len(drafts)]), run.greedy, run.rng),
                           logits[len(drafts)])
        # K/V were written for toks (last + drafts); keep those that are now part of the sequence.
        stored = min(len(toks), run.n - 1 - run.table.length)
        if job.status != "done":
            self.cache.commit(run.table, toks[:stored], share=False)
            self.cache.trim(run.table)
            if run.draft_table is not None:
                keep = min(run.draft_table.length, run.n - 1)
                self.draft_cache.truncate(run.draft_table, keep)

    # -- one token ------------------------------------------------------------------------------------------------

    def _distribution(self, job: Job, logits: torch.Tensor) -> torch.Tensor:
        run = job._run
        mask = None
        if run.constraint is not None:
            mask = run.constraint.mask()
        if run.stop_mask is not None and len(job.generated) < job.min_new_tokens:
            mask = run.stop_mask if mask is None else mask & run.stop_mask
        return process(logits, run.sampler, run.ids, run.rng, mask=mask, extra_banned=run.bans.get(run.n))

    def _advance(self, job: Job, logits: torch.Tensor, top: int | None = None) -> None:
        """Sample the next token from one logits row and take it. top: the row's argmax, computed for the whole
        batch at once, which is the token when nothing else shapes this job's choice here (plain greedy)."""
        run = job._run
        if top is not None and run.plain_greedy and run.constraint is None and not run.bans.get(run.n) \
                and (run.stop_mask is None or len(job.generated) >= job.min_new_tokens):
            token = top
        else:
            token = sample(self._distribution(job, logits), run.greedy, run.rng)
        self._take(job, token, logits)

    def _take(self, job: Job, token: int, logits: torch.Tensor) -> None:
        """Append a sampled token: stop conditions, text, banned strings, constraint, logprobs."""
        run = job._run
        if run.constraint is not None and token not in run.stop_tokens:
            run.constraint.advance(token)  # raises (ending the job) before a rejected token joins the output
        run.buf[run.n] = token
        run.n += 1
        job.generated.append(token)
        if run.ngram is not None:
            run.ngram.update(run.ids)
        run.ev()  # every token taken in this step is reported, whatever follows
        if token in run.stop_tokens:
            self._finish(job, "stop_token", stop_token=token)
            return
        logprob = top = None
        if job.return_logprobs or job.return_top_tokens:
            lp = torch.log_softmax(logits[: self.vocab].float(), 0)
            logprob = float(lp[token])
            if job.return_top_tokens:
                best = torch.topk(lp, job.return_top_tokens)
                pieces = self.tokenizer.pieces() if self.tokenizer else None
                top = {(pieces[i] if pieces else str(i)): float(v) for v, i in zip(best.values.tolist(), best.indices.tolist())}
        entry = _Held(token, len(run.held_text), logits if job.banned_strings else None, logprob, top)
        if run.decoder is None:
            self._release(run, [entry])
        else:
            run.held.append(entry)
            run.held_text += run.decoder.feed(token)
            if self._check_strings(job):
                return
        if len(job.generated) >= job.max_new_tokens:
            self._finish(job, "max_new_tokens")
        elif run.constraint is not None and run.constraint.done:
            self._finish(job, "constraint")

    def _check_strings(self, job: Job) -> bool:
        """Stop strings end the job; banned strings rewind; emit text (and its tokens) that can no longer start
        either. Returns True if the token was consumed by a stop or a rewind."""
        run = job._run
        text = run.held_text
        hit = min(((text.find(s), s) for s in job.stop_strings if s in text), default=None)
        if hit is not None:
            run.held_text = text[: hit[0]]
            run.held = [h for h in run.held if h.offset < hit[0]]
            self._finish(job, "stop_string", stop_string=hit[1])
            return True
        ban = min(((text.find(s), s) for s in job.banned_strings if s in text), default=None)
        if ban is not None:
            self._rewind(job, ban[0])
            return True
        safe = len(text) - _partial_hold(text, job.stop_strings)
        if job.banned_strings:  # banned strings rewind whole tokens: only emit up to a token boundary
            safe = min(safe, len(text) - _partial_hold(text, job.banned_strings))
            i = _token_index(run.held, len(text), safe)
            safe = run.held[i].offset if i < len(run.held) else len(text)
        if safe > 0:
            ends = _token_ends(run.held, len(text))
            done = [h for h, e in zip(run.held, ends) if e <= safe and h.offset < safe]
            run.held = [h for h, e in zip(run.held, ends) if not (e <= safe and h.offset < safe)]
            for h in run.held:
                h.offset = max(0, h.offset - safe)
            run.ev().text += text[:safe]
            job.text += text[:safe]
            run.held_text = text[safe:]
            self._release(run, done)
        return False

    @staticmethod
    def _release(run: _Run, held: list) -> None:
        """Report held tokens whose text is out (token ids, logprobs)."""
        ev = run.ev()
        for h in held:
            ev.token_ids.append(h.token)
            if ev.logprobs is not None:
                ev.logprobs.append(h.logprob)
            if ev.top_logprobs is not None:
                ev.top_logprobs.append(h.top)

    def _rewind(self, job: Job, char: int) -> None:
        """A banned string starts at `char` of the held text: drop the tokens from the one that produced it,
        ban that token at that position, and sample again from its logits."""
        run = job._run
        i = _token_index(run.held, len(run.held_text), char)
        h = run.held[i]
        token, offset, logits = h.token, h.offset, h.logits
        drop = len(run.held) - i
        position = run.n - drop
        run.n = position
        del job.generated[len(job.generated) - drop :]
        if run.constraint is not None:
            run.constraint.rollback(drop)
        run.held_text = run.held_text[:offset]
        del run.held[i:]
        run.decoder = StreamDecoder(self.tokenizer, skip_special=not job.decode_special_tokens)
        run.decoder.feed_many(job.generated)  # restore its state; the text was already accounted for
        if run.ngram is not None:
            run.ngram.reset()
        if run.table.length > position:
            self.cache.truncate(run.table, position)
        if run.draft_table is not None and run.draft_table.length > position:
            self.draft_cache.truncate(run.draft_table, position)
        run.bans.setdefault(position, set()).add(token)
        run.rewinds += 1
        self._advance(job, logits)

    # -- ending ---------------------------------------------------------------------------------------------------

    def _finish(self, job: Job, reason: str, stop_string: str | None = None, stop_token: int | None = None,
                flush: bool = True) -> None:
        run = job._run
        ev = run.ev()
        if flush and reason != "stop_string" and run.decoder is not None:
            run.held_text += run.decoder.flush()
        if flush:
            ev.text += run.held_text
            job.text += run.held_text
            self._release(run, run.held)
        run.held_text, run.held = "", []
        run.t_end = time.perf_counter()
        share = reason not in ("cancelled", "error")
        if run.table is not None:
            self.cache.close(run.table, share=share)
        if run.draft_table is not None:
            self.draft_cache.close(run.draft_table, share=share)
        if job in self.running:
            self.running.remove(job)
        job.status, job.eos_reason = "done", reason
        new = len(job.generated)
        first = run.t_first or run.t_end
        ev.eos, ev.eos_reason, ev.stop_string, ev.stop_token = True, reason, stop_string, stop_token
        ev.prompt_tokens, ev.cached_tokens, ev.new_tokens = run.prompt_len, run.cached_tokens, new
        ev.time_to_first_token = (run.t_first - run.t_enqueue) if run.t_first else None
        ev.time_total = run.t_end - run.t_enqueue
        ev.tokens_per_second = (new - 1) / (run.t_end - first) if new > 1 and run.t_end > first else None
        ev.drafted_tokens, ev.accepted_draft_tokens = run.drafted, run.accepted

    def _fail(self, job: Job, error: Exception) -> None:
        """End one job because of an error in its own processing (a constraint the model's token broke...):
        its final event has eos_reason "error" and the message in `error`; its pages are freed, others go on."""
        if job.status == "done":
            return
        message = f"{type(error).__name__}: {error}"
        try:
            self._finish(job, "error")
        except Exception:  # noqa: BLE001 - the text could not be flushed; end it without
            self._finish(job, "error", flush=False)
        job.error = job._run.ev().error = message
        job.error_code = job._run.ev().error_code = getattr(error, "code", None)

    def _take_event(self, job: Job) -> Event:
        ev = job._run.ev()
        job._run.event = None
        return ev


class _Held:
    """A generated token whose text is not out yet."""

    __slots__ = ("token", "offset", "logits", "logprob", "top")

    def __init__(self, token, offset, logits, logprob, top):
        self.token, self.offset, self.logits, self.logprob, self.top = token, offset, logits, logprob, top


def _token_ends(held: list[_Held], text_len: int) -> list[int]:
    return [held[i + 1].offset for i in range(len(held) - 1)] + [text_len]


def _token_index(held: list[_Held], text_len: int, char: int) -> int:
    """Index of the first held token whose text reaches past `char`, moved back over empty-text tokens just
    before it (bytes of the same character); len(held) if none."""
    ends = _token_ends(held, text_len)
    i = next((i for i, e in enumerate(ends) if e > char), len(held))
    while 0 < i < len(held) and held[i - 1].offset == held[i].offset:
        i -= 1
    return i


def _stored_tokens(job: Job) -> int:
    """Most tokens a job ever keeps in the cache: the last generated token is never fed back."""
    return len(job.input_ids) + job.max_new_tokens - 1


def _partial_hold(text: str, strings: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the strings."""
    best = 0
    for s in strings:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class GeneratorError(ExlError):
    """The generator was used wrongly."""
