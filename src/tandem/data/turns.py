"""Token ids of the environment's turns: through the tokenizer's chat template where the model
has one, as plain text otherwise.

The generated tokens of an episode are never re-tokenised: the context of every turn is the
previous context plus the tokens the generator produced plus the environment turn's tokens, so
the trainer scores exactly the sequence the generator sampled from. With a chat template an
environment turn is what the template puts between the end of an assistant message and the next
assistant message's first token (end of turn, the user message, the generation prompt).
"""

from __future__ import annotations

from typing import Any

_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class TurnEncoder:
    """``first(observation)`` and ``next(observation, last_token)`` as token ids."""

    def __init__(self, tokenizer: Any, chat_template: bool | None = None):
        """``chat_template``: None uses the tokenizer's template when it has one."""
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if chat_template and not has_template:
            raise ValueError("environment.chat_template is true but the tokenizer has no template")
        self.tokenizer = tokenizer
        self.chat = has_template if chat_template is None else chat_template
        self.eos_token_id = tokenizer.eos_token_id

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        )

    def first(self, observation: str) -> list[int]:
        """The episode's prompt: the first observation as a user message (or plain text)."""
        if not self.chat:
            return self._encode(observation)
        return self._encode(self._render([{"role": "user", "content": observation}], True))

    def next(self, observation: str, last_token: int | None) -> list[int]:
        """An environment turn after a model turn that ended with ``last_token``."""
        if not self.chat:
            return self._encode(observation)
        before = self._render(_PROBE, False)
        after = self._render([*_PROBE, {"role": "user", "content": observation}], True)
        if not after.startswith(before):
            raise ValueError("the chat template renders a conversation's prefix differently")
        # the template closes the assistant message itself; the model's own end-of-turn token
        # (its EOS) already did, when it stopped on it
        head = before[len(self._render(_PROBE[:1], True)) :]
        end_of_turn = head[head.index("y") + 1 :]
        delta = after[len(before) :]
        if last_token == self.eos_token_id:
            eos_text = self.tokenizer.decode([last_token])
            if end_of_turn.startswith(eos_text):
                delta = end_of_turn[len(eos_text) :] + delta
        else:
            delta = end_of_turn + delta
        return self._encode(delta)
