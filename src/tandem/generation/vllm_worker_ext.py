"""Methods mixed into vLLM's worker (``worker_extension_cls``); they run where the model lives.

Called through ``LLM.collective_rpc("tandem_...")``. Weights are loaded with the worker's
``reload_weights(weights_iterator=...)``: it re-runs vLLM's post-load processing, which the CPU
backend needs (its layers repack weights after loading, so ``model.load_weights`` alone leaves
stale kernels).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class TandemWorkerExtension:
    """Refit hooks of the tandem generator (the host is a vLLM ``Worker``)."""

    # provided by the vLLM worker this class is mixed into
    reload_weights: Any
    model_runner: Any
    device: torch.device
    rank: int

    def tandem_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load ``(hf_name, tensor)`` pairs in place; returns how many tensors were loaded."""
        count = 0

        def owned() -> Iterable[tuple[str, torch.Tensor]]:
            # vLLM's layerwise reload keeps the tensors of a layer until the whole layer has
            # arrived, but refit receivers yield views into bucket buffers that the next bucket
            # overwrites: views are copied, owned tensors pass as they are.
            nonlocal count
            for name, tensor in weights:
                count += 1
                yield name, (tensor.clone() if tensor._base is not None else tensor)

        self.reload_weights(weights_iterator=owned(), is_checkpoint_format=True)
        self._refresh_tied_lm_head()
        return count

    def _refresh_tied_lm_head(self) -> None:
        """Re-run the LM head's post-load processing when it is tied to the embeddings.

        With tied embeddings the stream carries only ``embed_tokens``; the reload refreshes
        that layer, but on CPU the LM head owns a GEMM kernel pre-packed from the old weight
        (vLLM 0.32 ``dispatch_cpu_unquantized_gemm``), which the reload never revisits: the
        logits stayed those of the old weights. Processing the head again re-packs it from the
        shared (now updated) weight; on GPU this processing is a no-op.
        """
        model = self.model_runner.get_model()
        hf_config = self.model_runner.model_config.hf_text_config
        lm_head = getattr(model, "lm_head", None)
        if not getattr(hf_config, "tie_word_embeddings", False) or lm_head is None:
            return
        embed = model.model.embed_tokens
        assert lm_head.weight.data_ptr() == embed.weight.data_ptr(), "LM head is not tied"
        lm_head.quant_method.process_weights_after_loading(lm_head)

    def tandem_receive_weights(self, spec: Any) -> int:
        """Join the refit transport described by ``spec`` and load the weights it delivers.
        Receiver ranks are 1 + the worker's rank (rank 0 is the trainer's sender)."""
        from tandem.weight_sync import make_receiver

        receiver = make_receiver(spec, self.device, rank=1 + self.rank)
        return self.tandem_load_weights(receiver.iter_weights())
