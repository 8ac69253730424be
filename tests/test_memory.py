"""The launcher's memory plan: parameter counts from the architecture on the meta device, the optimizer split the
trainer really uses, and the formula against the bytes torch really holds after a training step."""
import pytest
import torch

from recipe.config import load_config
from recipe.launch.plan import memory_estimate, param_counts, placement
from recipe.model import build_tiny_model, count_params, meta_model
from recipe.rl.trainer import build_optimizer, optimizer_split


class Tok:
    """What build_tiny_model reads of a tokenizer: the vocabulary `make base` trains to model.tiny.vocab_size."""

    pad_token_id = 1
    unk_token_id = None

    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def convert_tokens_to_ids(self, token):
        return 0


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(*overrides):
    return load_config(["preset=tiny", "run_root=unused", *overrides])


def trainer_model(cfg):
    """The tiny model as the RL trainer holds it: the `make base` build in float32, the master weights whatever
    model.dtype (recipe.rl.dist.load_sharded), on the CPU."""
    arch = cfg.model.tiny
    return build_tiny_model(arch, Tok(arch.vocab_size))


def held_bytes(model, optimizer) -> int:
    """Bytes of every parameter, gradient and optimizer state tensor, each storage counted once."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += [v for o in optimizer.optimizers for state in o.state.values() for v in state.values()
                if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_the_plan_formula_matches_the_bytes_torch_holds_after_a_step(optimizer, dtype):
    cfg = tiny(f"rl.optimizer={optimizer}", f"model.dtype={dtype}")
    torch.manual_seed(0)
    model = trainer_model(cfg)
    opt = build_optimizer(model, cfg.rl)
    tokens = torch.randint(0, cfg.model.tiny.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=getattr(torch, dtype), enabled=dtype != "float32"):  # as train_step runs it
        model(input_ids=tokens).logits.float().mean().backward()
    opt.step()  # every optimizer state exists from here on; no zero_grad: the gradients stay held
    assert all(p.grad is not None for p in model.parameters())
    assert all(p in o.state for o in opt.optimizers for g in o.param_groups for p in g["params"])
    measured = held_bytes(model, opt)
    planned = memory_estimate(cfg, placement(cfg))["trainer_bytes_per_gpu"]  # one process: world size 1
    assert abs(planned / measured - 1) < 0.10, (planned, measured)


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_the_plan_counts_the_split_build_optimizer_makes(optimizer):
    cfg = tiny(f"rl.optimizer={optimizer}")
    model = trainer_model(cfg)
    opt = build_optimizer(model, cfg.rl)
    names = {id(p): n for n, p in model.named_parameters()}
    by_optimizer = {type(o).__name__: {names[id(p)] for g in o.param_groups for p in g["params"]}
                    for o in opt.optimizers}
    muon, adamw = optimizer_split(meta_model(cfg.model).named_parameters(), cfg.rl.optimizer)
    assert by_optimizer.get("Muon", set()) == {n for n, _ in muon}
    assert by_optimizer["AdamW"] == {n for n, _ in adamw}
    counts = param_counts(cfg)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    assert counts["muon"] == sum(numel[n] for n in by_optimizer.get("Muon", ()))
    assert counts["adamw"] == sum(numel[n] for n in by_optimizer["AdamW"])
    assert counts["total"] == sum(numel.values())


def test_glm45_air_counted_from_its_architecture_matches_the_model_card():
    cfg = load_config(["preset=intellect3"])
    model = meta_model(cfg.model)
    assert all(p.is_meta for p in model.parameters())
    # transformers builds 46 decoder layers: the checkpoint's MTP layer (model.layers.46) is not among them
    assert not any(n.startswith("model.layers.46.") for n, _ in model.named_parameters())
    total, active = count_params(model)
    assert abs(total / 106e9 - 1) < 0.03, total  # the card's 106B total
    assert abs(active / 12e9 - 1) < 0.10, active  # and 12B active
    counts = param_counts(cfg)
    # Muon takes all but the embeddings, the head, norms and biases (tests/test_muon.py): 98.84%
    assert counts["muon"] + counts["adamw"] == total and 0.988 < counts["muon"] / total < 0.989
