"""The trainer's side of every refit: what it streams, whether the stream is live, and the
sender (trainer rank 0 only).

```python
source = WeightSource(policy, refit_config, precision="bf16", num_receivers=2, host=node_ip)
spec = source.prepare()      # every rank; rank 0 returns the spec, the others None
source.send()                # every rank, while the generators receive (a collective under FSDP2)
```
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

from tandem.config.models import RefitConfig
from tandem.trainer.policy_trainer import PolicyTrainer
from tandem.weight_sync import RefitSender, RefitSpec, make_sender, metadata_of

WeightStream = Iterable[tuple[str, torch.Tensor]]


class WeightSource:
    """Streams ``policy``'s weights to the generators, cast to ``dtype`` (the generators'; None:
    the trainer's own). ``precision="fp8"`` quantises them on the way
    (``quant.quantize_weight_stream``). ``host``: the address the generators reach this node at
    (its IP when they run on other nodes: split across nodes).

    A LoRA policy (``policy.lora``) streams its adapters only with ``refit.lora=adapter``
    (``PolicyTrainer.iter_adapter``: peft's names, B scaled by alpha / rank, bytes in proportion
    to the rank), which the generators apply; with ``merged``, the weights with the adapters
    merged in, in the base model's names (``PolicyTrainer.iter_weights``)."""

    def __init__(
        self,
        policy: PolicyTrainer,
        config: RefitConfig,
        precision: Literal["bf16", "fp8"] = "bf16",
        num_receivers: int = 1,
        dtype: torch.dtype | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.policy = policy
        self.config = config
        self.fp8 = precision == "fp8"
        self.dtype = dtype
        self.num_receivers = num_receivers
        self.host = host
        self.adapter = policy.peft is not None and config.lora == "adapter"
        """Whether a refit sends the LoRA adapters only."""
        if self.adapter and self.fp8:
            raise ValueError("FP8 refits carry full weights: use refit.lora=merged with fp8")
        self._sender: RefitSender | None = None
        self._live = False  # of the prepared refit

    def live(self) -> bool:
        """Whether a refit now sends the parameters themselves, which stay put until it ends
        (``PolicyTrainer.streams_live_weights``; FP8 quantisation and casts make new tensors)."""
        if not self.policy.streams_live_weights or self.fp8 or self.adapter:
            return False
        return self.dtype is None or all(
            dtype == self.dtype for _, _, dtype in self.policy.weight_metadata()
        )

    def _metadata(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        if self.adapter:
            return self.policy.adapter_metadata(self.dtype)
        return self.policy.weight_metadata(self.dtype)

    def _weights(self) -> WeightStream:
        if self.adapter:
            return self.policy.iter_adapter(self.dtype)
        return self.policy.iter_weights(self.dtype)

    def _stream(self, stream: WeightStream) -> WeightStream:
        if self.fp8:
            from tandem.quant.fp8 import quantize_weight_stream

            return quantize_weight_stream(iter(stream))
        return stream

    def prepare(self) -> RefitSpec | None:
        """Plan the next refit: the metadata of the stream (the same transform over meta
        tensors) and, when live, the parameters, whose memory a colocated receiver on CUDA maps
        as it attaches. Rank 0 returns the spec; other ranks None."""
        if self.policy.rank != 0:
            return None
        if self._sender is None:
            self._sender = make_sender(
                self.config, self.policy.device, num_receivers=self.num_receivers, host=self.host
            )
        metas = (
            (name, torch.empty(shape, dtype=dtype, device="meta"))
            for name, shape, dtype in self._metadata()
        )
        self._live = self.live()
        live = [tensor for _, tensor in self.policy.iter_weights()] if self._live else []
        return self._sender.prepare(metadata_of(self._stream(metas)), live_tensors=live)

    def stream(self) -> WeightStream:
        """What a refit sends, as a stream (every rank iterates it; rank 0 yields): for a
        receiver in this process, which loads it without a transport."""
        return self._stream(self._weights())

    def send(self) -> dict[str, float]:
        """Send the prepared refit; rank 0 returns its ``SendStats.as_dict()``, other ranks take
        part in the gathers and return {}."""
        if self.policy.rank != 0:
            for _ in self.stream():
                pass
            return {}
        if self._sender is None:
            raise RuntimeError("send() without prepare(); call prepare() first")
        if self._live:  # one rank: no gathers to take part in
            return self._sender.send().as_dict()
        return self._sender.send(self.stream()).as_dict()

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
