"""The RL trainer on a tiny random Glm4MoeForCausalLM: optimizers, one step, exact checkpoint round trip.
(Several ranks: tests/test_distributed.py.)"""
import copy

import pytest
import torch

from recipe.config import RLConfig, TinyArch
from recipe.rl.orchestrator import Sample
from recipe.rl.trainer import (build_optimizer, build_scheduler, checkpoint_model_state, latest_checkpoint,
                               load_checkpoint, save_checkpoint, scheduler_for, train_step)

CPU = torch.device("cpu")


class Tok:
    pad_token_id = 1

    def __len__(self):
        return 64

    def convert_tokens_to_ids(self, t):
        return 0

    unk_token_id = None


def tiny_model(seed=0):
    from recipe.model import build_tiny_model

    arch = TinyArch(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, n_routed_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=64)
    return build_tiny_model(arch, Tok(), seed=seed)


def samples():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(4):
        comp = torch.randint(2, 64, (5,), generator=g).tolist()
        out.append(Sample([2, 3, 4], comp, [-4.0] * 5, [1] * 5, 1.0 if i % 2 else -1.0, 0.0, 0, "math"))
    return out


def test_muon_takes_every_weight_matrix_but_embeddings_and_head_adamw_the_rest():
    model = tiny_model()
    opt = build_optimizer(model, RLConfig(optimizer="muon", lr=1e-3))
    muon, adamw = opt.optimizers
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[i] for i in muon_ids} == {n for n, p in model.named_parameters()
                                            if p.ndim >= 2 and "embed_tokens" not in n and "lm_head" not in n}
    muon_names = {names[i] for i in muon_ids}
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
            "model.layers.1.mlp.experts.down_proj"} <= muon_names  # the router and the 3-D experts
    assert all(p.ndim < 2 or "embed" in names[id(p)] or "lm_head" in names[id(p)]
               for g in adamw.param_groups for p in g["params"])
    assert sum(len(g["params"]) for o in opt.optimizers for g in o.param_groups) == len(list(model.parameters()))


def test_a_step_changes_weights_and_checkpoint_round_trip_is_exact(tmp_path):
    for name in ("adamw", "muon"):
        cfg = RLConfig(optimizer=name, lr=1e-3, warmup_steps=2, micro_batch_size=3)
        model = tiny_model()
        opt = build_optimizer(model, cfg)
        sch = build_scheduler(opt, cfg.warmup_steps)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        stats = train_step(model, opt, sch, CPU, samples(), cfg, pad_id=1)
        assert stats["loss_tokens"] == 20 and stats["grad_norm"] > 0
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        root = tmp_path / name
        save_checkpoint(root, 1, model, opt, sch, {"cursor": {"math": 3}}, keep=2)
        # continue one more step in place, and from the checkpoint: the results must match exactly
        torch.manual_seed(123)
        train_step(model, opt, sch, CPU, samples(), cfg, pad_id=1)
        model2 = tiny_model(seed=9)
        opt2 = build_optimizer(model2, cfg)
        sch2 = build_scheduler(opt2, cfg.warmup_steps)
        step, orch = load_checkpoint(latest_checkpoint(root), model2, opt2, sch2)
        assert step == 1 and orch == {"cursor": {"math": 3}}
        saved = checkpoint_model_state(root / "step_000001")  # read back alone: the weights after step 1
        assert saved.keys() == model2.state_dict().keys()
        assert all(torch.equal(saved[k], v) for k, v in model2.state_dict().items())
        torch.manual_seed(123)
        train_step(model2, opt2, sch2, CPU, samples(), cfg, pad_id=1)
        for k, v in model.state_dict().items():
            assert torch.allclose(v, model2.state_dict()[k], atol=1e-6), (name, k)


def test_the_lr_warms_up_stays_and_decays_linearly_over_the_last_steps_and_a_restored_schedule_goes_on():
    def lrs(opt, sch, steps):
        out = []
        for _ in range(steps):
            out.append([g["lr"] for o in opt.optimizers for g in o.param_groups])
            opt.step()
            for s in sch:
                s.step()
        return out

    # as the RL stage and the GPU check build it: from the config's schedule keys
    cfg = RLConfig(optimizer="muon", lr=1e-3, warmup_steps=2, decay_steps=4, max_steps=10, min_lr_share=0.1)
    opt = build_optimizer(tiny_model(), cfg)
    seen = lrs(opt, scheduler_for(opt, cfg), 10)
    assert all(len(set(step)) == 1 for step in seen)  # Muon's and AdamW's groups alike
    got = [step[0] for step in seen]
    want = [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 7e-4, 4e-4, 1e-4]  # the last step at lr * min_lr_share
    assert got == pytest.approx(want)
    opt = build_optimizer(tiny_model(), cfg)
    assert [s[0] for s in lrs(opt, build_scheduler(opt, 0), 3)] == pytest.approx([1e-3] * 3)  # constant: no decay
    # a schedule restored from its state (a resumed run) goes on where it was
    opt = build_optimizer(tiny_model(), cfg)
    sch = build_scheduler(opt, 2, 4, 10, 0.1)
    lrs(opt, sch, 7)
    state = [s.state_dict() for s in sch]
    opt2 = build_optimizer(tiny_model(), cfg)
    sch2 = build_scheduler(opt2, 2, 4, 10, 0.1)
    for o2, o in zip(opt2.optimizers, opt.optimizers):  # as load_checkpoint: the optimizer's state holds its lr
        o2.load_state_dict(o.state_dict())
    for s, st in zip(sch2, state):
        s.load_state_dict(st)
    assert [s[0] for s in lrs(opt2, sch2, 3)] == pytest.approx(want[7:])


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    model = tiny_model()
    cfg = RLConfig()
    opt = build_optimizer(model, cfg)
    sch = build_scheduler(opt, 0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, opt, sch, {}, keep=2)
    assert [p.name for p in sorted(tmp_path.glob("step_*"))] == ["step_000002", "step_000003"]
    assert latest_checkpoint(tmp_path).name == "step_000003"


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


DAMAGES = {  # file of the newest checkpoint -> how it is damaged
    "state/__0_0.distcp": "truncated",  # the DCP shard of model and optimizer
    "state/.metadata": "truncated",
    "scheduler.pt": "truncated",
    "rng_rank0.pt": "removed",
    "meta.json": "removed",
}


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, capsys):
    cfg = RLConfig(optimizer="adamw", lr=1e-3, micro_batch_size=4)
    for damaged, how in DAMAGES.items():
        root = tmp_path / damaged.replace("/", "_")
        model = tiny_model()
        opt = build_optimizer(model, cfg)
        sch = build_scheduler(opt, 0)
        train_step(model, opt, sch, CPU, samples(), cfg, pad_id=1)
        save_checkpoint(root, 1, model, opt, sch, {"cursor": {"math": 1}}, keep=3)
        at_1 = {k: v.clone() for k, v in model.state_dict().items()}
        opt_at_1 = copy.deepcopy(opt.state_dict())
        train_step(model, opt, sch, CPU, samples(), cfg, pad_id=1)
        save_checkpoint(root, 2, model, opt, sch, {"cursor": {"math": 2}}, keep=3)
        newest = root / "step_000002" / damaged
        _truncate(newest) if how == "truncated" else newest.unlink()
        capsys.readouterr()
        last = latest_checkpoint(root)
        err = capsys.readouterr().err.splitlines()
        assert last.name == "step_000001" and not (root / "step_000002").exists()
        assert len(err) == 1 and err[0].startswith(f"rl: skipping checkpoint step_000002: {damaged} "), err
        model2 = tiny_model(seed=9)
        opt2 = build_optimizer(model2, cfg)
        sch2 = build_scheduler(opt2, 0)
        step, orch = load_checkpoint(last, model2, opt2, sch2)
        assert step == 1 and orch == {"cursor": {"math": 1}}
        assert all(torch.equal(v, at_1[k]) for k, v in model2.state_dict().items())
        got = opt2.state_dict()["optimizers"][0]["state"]
        want = opt_at_1["optimizers"][0]["state"]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[i]["exp_avg"], want[i]["exp_avg"]) for i in want)


def test_no_intact_checkpoint_starts_over_with_one_line(tmp_path, capsys):
    model = tiny_model()
    opt = build_optimizer(model, RLConfig())
    sch = build_scheduler(opt, 0)
    save_checkpoint(tmp_path, 1, model, opt, sch, {}, keep=2)
    _truncate(tmp_path / "step_000001" / "state" / "__0_0.distcp")
    capsys.readouterr()
    assert latest_checkpoint(tmp_path) is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[1] == f"rl: no intact checkpoint left in {tmp_path}; starting over from step 0"


def test_a_checkpoint_of_the_earlier_one_process_format_is_refused_not_removed(tmp_path):
    import pytest

    from recipe.errors import StageError

    old = tmp_path / "step_000003"
    old.mkdir()
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "orchestrator.json", "meta.json"):
        (old / name).write_text("{}")
    with pytest.raises(StageError, match="earlier version of the recipe"):
        latest_checkpoint(tmp_path)
    assert old.exists()


def test_bf16_compute_keeps_float32_master_weights_that_a_tiny_lr_still_moves(tmp_path):
    """The real presets compute in bf16 with lr 1e-6: held in bf16 the weights would not move (an update below
    half a bf16 step rounds away); load_sharded keeps them float32 and runs the forward in bf16."""
    from recipe.rl.dist import World, load_sharded
    from recipe.weights import read_weights
    from recipe.rl.trainer import publish_weights
    from tests.fakes import save_tiny_qa_model

    save_tiny_qa_model(tmp_path / "start")
    model, tok = load_sharded(tmp_path / "start", World(), 1, "bfloat16", "sdpa")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    cfg = RLConfig(optimizer="adamw", lr=1e-6, weight_decay=0.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = build_optimizer(model, cfg)
    batch = [Sample([5, 6, 7], [8 + i, 9, 10], [-5.0] * 3, [1] * 3, 1.0 if i % 2 else -1.0, 0.0, 0, "math")
             for i in range(4)]
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(out.logits.dtype))
    train_step(model, opt, build_scheduler(opt, 0), CPU, batch, cfg, tok.pad_token_id, compute_dtype=torch.bfloat16)
    assert seen and set(seen) == {torch.bfloat16}  # the forwards (prompts, then completions) ran in bf16
    after = model.state_dict()
    total = sum(v.numel() for v in before.values())
    moved = sum((after[k] != before[k]).sum().item() for k in before) / total
    moved_in_bf16 = sum((after[k].bfloat16() != before[k].bfloat16()).sum().item() for k in before) / total
    assert moved > 0.5 and moved_in_bf16 < 0.05, (moved, moved_in_bf16)  # bf16 weights would keep 95% unmoved
    published = read_weights(publish_weights(model, tmp_path / "weights", 1, dtype=torch.bfloat16))
    assert {v.dtype for v in published.values() if v.is_floating_point()} == {torch.bfloat16}  # engines: bf16


def test_activation_checkpointing_takes_the_same_step(tmp_path):
    """rl.activation_checkpointing (the production run's [model.ac]) recomputes activations: the same step."""
    from recipe.rl.dist import World, load_sharded
    from tests.fakes import save_tiny_qa_model

    save_tiny_qa_model(tmp_path / "start")
    states = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model, tok = load_sharded(tmp_path / "start", World(), 1, "float32", "sdpa", checkpointed)
        assert model.is_gradient_checkpointing == checkpointed
        cfg = RLConfig(optimizer="adamw", lr=1e-3, micro_batch_size=2, share_prompts=False)  # the same path
        opt = build_optimizer(model, cfg)
        batch = [Sample([5, 6, 7], [8 + i, 9, 10, 11], [-5.0] * 4, [1] * 4, 1.0 if i % 2 else -1.0, 0.0, 0, "math")
                 for i in range(4)]
        train_step(model, opt, build_scheduler(opt, 0), CPU, batch, cfg, tok.pad_token_id)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    assert max((states[0][k] - states[1][k]).abs().max().item() for k in states[0]) < 1e-6
    assert any(not torch.equal(states[0][k], v) for k, v in load_sharded(tmp_path / "start", World(), 1, "float32",
                                                                          "sdpa")[0].state_dict().items())


def test_the_models_attention_takes_grouped_heads_as_they_are_and_trains_as_stock_sdpa():
    """recipe.model.attention: built and loaded models run sdpa with enable_gqa on the CPU; a training step on a
    padded batch (a mask, 2 query heads on 1 key/value head) gets the loss and gradients of transformers' sdpa."""
    from recipe.model.attention import SDPA_GQA

    ours = tiny_model()
    assert ours.config._attn_implementation == SDPA_GQA
    stock = copy.deepcopy(ours)
    stock.set_attn_implementation("sdpa")
    cfg = RLConfig(lr=1e-3, micro_batch_size=4)
    batch = samples()
    batch[0] = Sample([2, 3, 4, 5, 6, 7], batch[0].completion_ids, [-4.0] * 5, [1] * 5, 1.0, 0.0, 0, "math")  # longer
    stats = [train_step(m, build_optimizer(m, cfg), [], CPU, batch, cfg, pad_id=1) for m in (ours, stock)]
    assert abs(stats[0]["loss"] - stats[1]["loss"]) < 1e-6
    assert abs(stats[0]["grad_norm"] - stats[1]["grad_norm"]) < 1e-5 * stats[1]["grad_norm"]
    for (name, a), b in zip(ours.named_parameters(), stock.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name  # after the same optimizer step


def packed_rows(lengths_per_sequence, width, seed=0):
    """A packed batch as recipe.sft.PackedBatchCollator lays it out: rows end to end, positions restarting at each
    row, the rest of a sequence a padding row of its own (out of the loss), no attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 64, (len(lengths_per_sequence), width), generator=g)
    positions = torch.zeros_like(ids)
    labels = ids.clone()
    for s, lengths in enumerate(lengths_per_sequence):
        at = 0
        for n in lengths:
            positions[s, at:at + n] = torch.arange(n)
            at += n
        positions[s, at:] = torch.arange(width - at)
        labels[s, at:] = -100
    labels[positions == 0] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def test_packed_rows_attend_within_themselves_with_the_loss_and_gradients_of_the_masked_sdpa():
    """recipe.model.attention.sdpa_rows: on a packed batch each row attends to itself only, batched by length
    (rows of 1 to 13 tokens in five calls, padding rows); the loss and gradients are those of
    sdpa with transformers' block-diagonal mask, and the mask's absence matters (one long row differs)."""
    from recipe.model.attention import SDPA_GQA, SDPA_ROWS, RowPlan

    batch = packed_rows([[5, 1, 7, 3], [13, 2, 4], [6, 6, 6, 1], [2, 9]], width=20)
    plan = RowPlan(batch["position_ids"], rows_per_call=4)
    # 13 rows and 4 padding rows (4, 1, 1 and 9 long), longest first, 4 to a call
    assert [rows for rows, _ in plan.calls] == [4, 4, 4, 4, 1]
    assert [longest for _, longest in plan.calls] == [13, 6, 4, 2, 1]
    results = {}
    for name in (SDPA_GQA, SDPA_ROWS):
        model = tiny_model()
        model.set_attn_implementation(name)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        results[name] = loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (masked, g_masked), (rows, g_rows) = results[SDPA_GQA], results[SDPA_ROWS]
    assert abs(masked - rows) < 1e-6
    assert g_masked.keys() == g_rows.keys()
    for n, grad in g_masked.items():
        torch.testing.assert_close(g_rows[n], grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")
    model = tiny_model()
    model.set_attn_implementation(SDPA_ROWS)
    with torch.no_grad():
        whole = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss.item()
    assert abs(whole - rows) > 1e-3  # without position ids a sequence is one row: its rows would see each other


def test_packed_rows_attention_takes_a_padded_batch_as_sdpa_does():
    """sdpa_rows with an attention mask (a padded batch, left-padded rows) and with a KV cache is sdpa_gqa."""
    from recipe.model.attention import SDPA_GQA, SDPA_ROWS

    ids = torch.tensor([[1, 1, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    out = {}
    for name in (SDPA_GQA, SDPA_ROWS):
        model = tiny_model().eval()
        model.set_attn_implementation(name)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                 pad_token_id=1)
        out[name] = logits, gen
    torch.testing.assert_close(out[SDPA_ROWS][0], out[SDPA_GQA][0], atol=1e-6, rtol=0)
    assert torch.equal(out[SDPA_ROWS][1], out[SDPA_GQA][1])


def test_shared_prompts_take_the_unshared_step_with_each_prompt_run_once():
    """rl.share_prompts: a group's samples share their prompt, whose forward runs once a step (keys, values and
    last logits read by every completion); the loss, gradient and step are those of running every sample whole.
    Prompts of different lengths, completions of 1 to 7 tokens, environment tokens (loss mask 0) inside. (The
    gradients, not the weights after Adam: a key bias has a zero gradient, whose rounding noise Adam scales up.)
    The completions go end to end in passes of micro_batch_size samples: 4 (three passes, a call to sdpa each) and 9
    (one pass, two calls of ROWS_PER_CALL rows and of 1)."""
    from recipe.model.attention import ROWS_PER_CALL
    g = torch.Generator().manual_seed(1)
    batch = []
    for p, prompt in enumerate([[2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]):
        for k, n in enumerate((1, 4, 7)):
            comp = torch.randint(2, 64, (n,), generator=g).tolist()
            mask = [0 if (n > 3 and i == 2) else 1 for i in range(n)]
            batch.append(Sample(prompt, comp, (-3.0 - torch.rand(n, generator=g)).tolist(), mask,
                                float(k) - 0.9 + 0.3 * p, 0.0, 0, "math"))  # none 0: all 9 run
    runs = []
    for share, micro in ((True, 4), (True, 9), (False, 4)):
        model = tiny_model()
        tokens = []
        model.model.embed_tokens.register_forward_hook(lambda m, args, out: tokens.append(args[0].shape))
        grads = {}
        for name, p in model.named_parameters():
            p.register_hook(lambda grad, name=name: grads.__setitem__(name, grads.get(name, 0) + grad))
        cfg = RLConfig(lr=1e-3, micro_batch_size=micro, share_prompts=share)
        stats = train_step(model, build_optimizer(model, cfg), [], CPU, batch, cfg, pad_id=1)
        runs.append((stats, grads, tokens))
    whole, g_whole, t_whole = runs[-1]
    assert ROWS_PER_CALL < 9
    for (shared, g_shared, t_shared), passes in zip(runs[:2], (3, 1)):
        assert t_shared[0] == (3, 9)  # first the three prompts, once each (padded to the longest)
        # then the completions end to end, no padding: 9 samples of 1 + 4 + 7 tokens each
        assert len(t_shared) == 1 + passes and all(s[0] == 1 for s in t_shared[1:])
        assert sum(s[1] for s in t_shared[1:]) == 3 * (1 + 4 + 7)
        assert sum(s.numel() for s in t_shared) < sum(s.numel() for s in t_whole)
        assert abs(shared["loss"] - whole["loss"]) < 1e-6 and shared["loss_tokens"] == whole["loss_tokens"]
        assert abs(shared["grad_norm"] - whole["grad_norm"]) < 1e-5 * whole["grad_norm"]
        assert g_shared.keys() == g_whole.keys()
        for name in g_whole:
            assert torch.allclose(g_shared[name], g_whole[name], atol=1e-6, rtol=1e-4), name


def test_samples_of_advantage_zero_are_not_run_but_counted_and_the_step_is_that_of_running_them():
    """Where the online filter is off (prime-rl's production run) a group without signal stays in the batch with
    advantage 0: its loss terms are r * 0, so train_step runs neither its forward nor its backward, and its tokens
    still count in the normaliser. The reference runs those samples with an advantage of 1e-30 (a gradient
    far below float32's rounding of the rest). A step whose samples all have advantage 0 still gives the optimizer
    a zero gradient for every parameter, so AdamW's weight decay moves the weights as it would after running them."""
    def batch(zero: float):
        g = torch.Generator().manual_seed(2)
        rows = []
        for p, (prompt, advs) in enumerate([([2, 3, 4], (1.0, -1.0, zero)), ([5, 6, 7, 8], (zero, zero, zero)),
                                            ([9, 10], (-0.5, 0.5, zero))]):
            for k, a in enumerate(advs):
                n = 2 + 2 * k
                comp = torch.randint(2, 64, (n,), generator=g).tolist()
                rows.append(Sample(prompt, comp, (-3.0 - torch.rand(n, generator=g)).tolist(), [1] * n, a, 0.0, 0,
                                   "math"))
        return rows

    def step(rows, share):
        model = tiny_model()
        seen = []
        model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
        grads = {}
        for name, p in model.named_parameters():
            p.register_hook(lambda grad, name=name: grads.__setitem__(name, grads.get(name, 0) + grad))
        cfg = RLConfig(optimizer="adamw", lr=1e-2, weight_decay=0.1, micro_batch_size=2, share_prompts=share)
        stats = train_step(model, build_optimizer(model, cfg), [], CPU, rows, cfg, pad_id=1)
        return stats, grads, sum(seen), {k: v.clone() for k, v in model.state_dict().items()}

    zero_tokens = sum(len(s.completion_ids) for s in batch(0.0) if s.advantage == 0)
    assert zero_tokens == 6 + (2 + 4 + 6) + 6  # five samples of advantage 0: one in each group, one group all
    for share in (True, False):
        (skip, g_skip, t_skip, _), (run, g_run, t_run, _) = step(batch(0.0), share), step(batch(1e-30), share)
        assert t_skip < t_run  # fewer tokens went through the model
        assert skip["loss_tokens"] == run["loss_tokens"] == sum(len(s.completion_ids) for s in batch(0.0))
        assert skip["skipped_tokens"] == zero_tokens and run["skipped_tokens"] == 0
        assert abs(skip["loss"] - run["loss"]) < 1e-6 and abs(skip["grad_norm"] - run["grad_norm"]) < 1e-5
        assert g_skip.keys() == g_run.keys()
        for name in g_run:
            assert torch.allclose(g_skip[name], g_run[name], atol=1e-7, rtol=1e-4), name

    flat = [s for s in batch(0.0) if s.advantage == 0]
    (skip, g_skip, t_skip, w_skip), (run, _, _, w_run) = step(flat, True), step(
        [Sample(s.prompt_ids, s.completion_ids, s.logprobs, s.loss_mask, 1e-30, 0.0, 0, "math") for s in flat], True)
    assert t_skip == 1 and skip["skipped_tokens"] == zero_tokens  # one token: the pass that gives zero gradients
    assert set(g_skip) == {n for n, _ in tiny_model().named_parameters()}
    assert all(float(g.abs().max()) == 0.0 for g in g_skip.values())
    start = tiny_model().state_dict()
    assert any(not torch.equal(w_skip[k], start[k]) for k in start)  # weight decay moved them
    assert all(torch.allclose(w_skip[k], w_run[k], atol=1e-9, rtol=0) for k in w_run)


def test_a_tree_layout_takes_one_level_of_prefixes_and_no_empty_segment():
    from recipe.model.attention import TreeRows

    layout = TreeRows([3, 2, 1, 4], [-1, 0, 0, -1])
    assert sorted(layout.pick.tolist()) == sorted(set(layout.pick.tolist())) and len(layout.pick) == 10
    assert layout.queries[layout.pick].tolist() == list(range(10))  # each token's output comes from its own slot
    for lengths, parents in (([3, 2, 1], [-1, 0, 1]), ([3, 0], [-1, 0])):
        with pytest.raises(ValueError, match="every segment needs a token, and a parent has no parent"):
            TreeRows(lengths, parents)
