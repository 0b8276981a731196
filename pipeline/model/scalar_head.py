"""A policy's body with a zero-initialised scalar head on the final hidden state at a sequence's last token: the
shape of SPA's progress estimator and of GAE's critic (docs/credit-assignment.md, SPA; GAE).

The body is the initial policy's architecture without its LM head (`AutoModel`), all of its weights training or,
with LoRA, fresh adapters on the frozen body (B = 0: the same hidden states). The head starts at zero, so that a
new model scores every sequence 0. Where the head reads is the caller's choice of sequence: a turn's prompt and
response (SPA: the turn's last token) or its prompt alone (GAE: the state before the response).

torch and transformers are imported inside the functions (start-up cost: the credit methods that use this module
are imported whenever params load).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.data.section import FitBatching


def pad_id(tokenizer) -> int:
    """The id that pads a batch for these models: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


class ScalarHeadModel:
    """A base model and a scalar head; subclasses name the file the head is saved in (`head_file`)."""

    head_file = "scalar_head.pt"
    kind = "scalar-head model"

    def __init__(self, body, hidden_size: int):
        import torch  # start-up cost: torch

        self.body = body
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.modules = torch.nn.ModuleDict({"body": body, "head": self.head})
        self.base: Path | None = None   # the initial policy a LoRA body adapts

    @classmethod
    def from_policy(cls, path: str | Path, dtype: str = "float32", device=None, lora=None, seed: int = 0):
        """The body of the policy folder at `path`, fp32 master weights computing in `dtype`; with `lora` (a
        `LoraSettings`), fresh adapters on the frozen body (B = 0: the same hidden states)."""
        from pipeline.model.policy import with_lora  # start-up cost: torch

        model = cls._build(path, dtype, device,
                           None if lora is None else lambda body: with_lora(body, lora, seed, None))
        model.base = Path(path) if lora is not None else None
        return model

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", device=None):
        """The model `save` wrote: a whole body, or LoRA adapters on the initial policy's body."""
        import torch  # start-up cost: torch

        from pipeline.model.policy import adapter_base, is_adapter  # start-up cost: torch

        path = Path(path)
        if not (path / cls.head_file).is_file():
            raise FileNotFoundError(f"{path}: not a {cls.kind} ({cls.head_file} missing)")
        model = cls._build(path, dtype, device)
        model.base = adapter_base(path) if is_adapter(path) else None
        model.head.load_state_dict(torch.load(path / cls.head_file, weights_only=True, map_location="cpu"))
        return model

    @classmethod
    def _build(cls, path, dtype, device, wrap=None):
        from transformers import AutoModel  # start-up cost: transformers

        from pipeline.model.policy import load_weights, resolve_device  # start-up cost: torch
        from pipeline.model.precision import mark  # start-up cost: torch

        body = load_weights(path, dtype, train=True, auto_class=AutoModel)
        body = wrap(body) if wrap is not None else body
        model = cls(body, body.config.hidden_size)
        model.modules.to(device=None if device is None else resolve_device(device))
        mark(model.modules, dtype)
        return model

    def save(self, path: str | Path) -> None:
        """The body (a LoRA body: its adapter, pointing at the initial policy) and the head."""
        import torch  # start-up cost: torch

        from pipeline.model.policy import save_weights  # start-up cost: torch

        path = Path(path)
        save_weights(self.body, path, self.base)
        torch.save(self.head.state_dict(), path / self.head_file)

    def parameters(self):
        """The weights that train (a LoRA body's adapters and the head; else all)."""
        return [q for q in self.modules.parameters() if q.requires_grad]

    def train(self):
        self.modules.train()

    def eval(self):
        self.modules.eval()

    def __call__(self, ids, attn):
        """The head's value at each row's last attended token (right-padded rows)."""
        import torch  # start-up cost: torch

        from pipeline.model.precision import autocast  # start-up cost: torch

        device = self.head.weight.device
        ids, attn = ids.to(device), attn.to(device)
        with autocast(self.modules):
            hidden = self.body(input_ids=ids, attention_mask=attn).last_hidden_state
        last = attn.sum(1) - 1
        h = hidden[torch.arange(ids.shape[0], device=device), last]
        return self.head(h.float()).squeeze(-1)

    def packed(self, sequences):
        """The head's value at each sequence's last token, the sequences packed as one prefix tree
        (`pipeline.model.packing`): what `__call__` gives on their padded batch."""
        import torch  # start-up cost: torch

        from pipeline.model.packing import pack, tree_forward  # start-up cost: torch
        from pipeline.model.precision import autocast  # start-up cost: torch

        tree = pack(sequences)
        device = self.head.weight.device
        with autocast(self.modules), tree_forward(self.body, tree, device) as kwargs:
            hidden = self.body(**kwargs).last_hidden_state[0]
        last = torch.stack([path[-1] for path in tree.paths]).to(device)
        return self.head(hidden[last].float()).squeeze(-1)

    def _pass(self, prompts, responses, pad_id: int, packing: str):
        """The values of one forward pass: right-padded, or one prefix tree."""
        from pipeline.model.policy import pad_batch  # start-up cost: torch

        if packing == "tree":
            return self.packed([list(p) + list(r) for p, r in zip(prompts, responses)])
        ids, attn, _ = pad_batch(prompts, responses, pad_id)
        return self(ids, attn)

    def _parts(self, prompts, responses, batching: FitBatching) -> list[list[int]]:
        """The turns' forward passes (`pipeline.model.packing.passes`)."""
        from pipeline.model.packing import passes  # start-up cost: torch

        return passes(prompts, responses, list(range(len(prompts))), batching.batch_size, batching.packing,
                      batching.micro_batch_tokens)

    def _values(self, prompts, responses, pad_id: int, packing: str, parts: list[list[int]]):
        """The values of `parts`' passes, each back in its sequence's place."""
        import torch  # start-up cost: torch

        out = [self._pass([prompts[i] for i in part], [responses[i] for i in part], pad_id, packing)
               for part in parts]
        if not out:
            return torch.zeros(0)
        v = torch.cat(out)
        order = [i for part in parts for i in part]
        if order == list(range(len(prompts))):
            return v
        return v.new_zeros(len(prompts)).index_put((torch.tensor(order, device=v.device),), v)

    def values(self, prompts, responses, pad_id: int, batching: FitBatching, grad: bool = False):
        """One value per sequence `prompt + response` (an empty response: the prompt's last token), in the order
        given, computed in chunks of `batching.batch_size`: right-padded, or (`packing` tree) each chunk one prefix
        tree; with `micro_batch_tokens` too, trees of at most that many tokens (`pipeline.model.packing.passes`)."""
        import torch  # start-up cost: torch

        with torch.set_grad_enabled(grad):
            return self._values(prompts, responses, pad_id, batching.packing,
                                self._parts(prompts, responses, batching))

    def fit_step(self, prompts, responses, pad_id: int, batching: FitBatching, loss_of, stepper, where: str) -> float:
        """One optimiser step on `loss_of(v)`, `v` the values of all the given sequences (a loss that couples them,
        as SPA's sum over an episode's turns does), holding the graph of one forward pass at a time: where they
        take several passes, the values are first computed without a graph, `g = ∂loss/∂v` there, and each pass
        then runs again with its graph (`Stepper.backward_through`). The price is one forward pass more; memory is
        bounded by `batch_size` turns or `micro_batch_tokens` tokens, not by the batch.
        Returns the loss; a non-finite loss stops training before any gradient is taken (`NonFiniteError`)."""
        import torch  # start-up cost: torch

        parts = self._parts(prompts, responses, batching)
        if len(parts) <= 1:
            with torch.enable_grad():
                loss = loss_of(self._values(prompts, responses, pad_id, batching.packing, parts))
                stepper.minimize(loss, where)
            return float(loss.detach())
        with torch.no_grad():
            v = self._values(prompts, responses, pad_id, batching.packing, parts)
        with torch.enable_grad():
            v.requires_grad_(True)
            loss = loss_of(v)
            stepper.check(loss.detach(), where)
            (g,) = torch.autograd.grad(loss, v)
            stepper.optimizer.zero_grad(set_to_none=True)
            stepper.backward_through(parts, lambda part: self._pass([prompts[i] for i in part],
                                                                    [responses[i] for i in part], pad_id,
                                                                    batching.packing), g)
        stepper.step(where)
        return float(loss.detach())
