"""epdserve: LLM serving on Kubernetes with encoder / prefill / decode disaggregation.

The code folders (``engine/``, ``connectors/``, ``kernels/``, ``router/``, ``operator/``)
are mapped onto ``epdserve.<folder>`` and have no ``__init__.py`` of their own, so that
``operator/`` can never shadow the stdlib ``operator`` module. Their public names are
exported lazily from here (PEP 562 ``__getattr__`` on each sub-package), which keeps
``epdserve.router`` and ``epdserve.operator`` free of torch.
"""

import importlib

__version__ = "0.1.0"

# sub-package -> {public name: defining module}
PUBLIC_API: dict[str, dict[str, str]] = {
    "engine": {
        "LLM": "epdserve.engine.llm",
        "SamplingParams": "epdserve.engine.sampling_params",
        "RequestOutput": "epdserve.engine.outputs.request_output",
        "CompletionOutput": "epdserve.engine.outputs.request_output",
        "LoRARequest": "epdserve.engine.lora.request",
    },
    "kernels": {  # the backend registry, and each op's torch twin and Triton launcher
        **dict.fromkeys(
            ("KernelBackend", "BACKEND_NAMES", "get_backend", "default_backend"),
            "epdserve.kernels.backends",
        ),
        **{
            f"{op}_{impl}": f"epdserve.kernels.{module}_{impl}"
            for op, module in (
                ("paged_attention", "attention"),
                ("reshape_and_cache", "cache"),
                ("rms_norm", "norm"),
                ("rotary_embedding", "rotary"),
            )
            for impl in ("ref", "triton")
        },
    },
}


def _install_lazy_exports(subpackage: str, names: dict[str, str]) -> None:
    module = importlib.import_module(f"{__name__}.{subpackage}")

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(module, name, value)
        return value

    def __dir__():
        return sorted(set(module.__dict__) | set(names))

    module.__getattr__ = __getattr__
    module.__dir__ = __dir__


for _sub, _names in PUBLIC_API.items():
    _install_lazy_exports(_sub, _names)
