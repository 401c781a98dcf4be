"""`tformer chat CKPT`: a conversation in the terminal through the model's chat template,
each reply streamed as it is decoded and kept in the history the next prompt renders.

/reset starts the conversation again (the --system message stays), /exit (or end of input)
ends it, and Ctrl-C stops a reply without ending the session (the part already shown stays
in the history). From a pipe it reads one message a line and writes each reply on a line of
its own, so that a script, or a test, can hold a conversation.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

from tformer.api import SAMPLING, Weights
from tformer.arguments import Help
from tformer.cli.common import Checkpoint, Device, Threads

COMMANDS = {"/reset": "start the conversation again", "/exit": "end the session"}


def chat(
    checkpoint: Checkpoint,
    *,
    system: Annotated[str | None, Help("a system message that opens the conversation")] = None,
    max_new_tokens: Annotated[int, Help("the longest reply, in tokens")] = 512,
    temperature: Annotated[float, Help("0 is greedy")] = SAMPLING.temperature,
    top_k: Annotated[int, Help("sample from the k likeliest; 0 is off")] = SAMPLING.top_k,
    top_p: Annotated[
        float, Help("sample from the likeliest tokens of this total probability; 1 is off")
    ] = SAMPLING.top_p,
    seed: Annotated[int, Help("random seed of the sampling")] = SAMPLING.seed,
    weights: Weights = None,
    device: Device = "auto",
    threads: Threads = None,
) -> int:
    from tformer.api import check_generation_args, load
    from tformer.data.chat import template_of

    check_generation_args(max_new_tokens, temperature, top_k, top_p)
    model = load(checkpoint, weights=weights, device=device, threads=threads, needs="generate")
    template = template_of(model.tokenizer)
    terminal = sys.stdin.isatty()
    own = "" if model.tokenizer.chat_template else "; it has no chat template: role: text lines"
    print(f"chatting with {model.label} ({model.description}{own}); "
          + ", ".join(f"{c} to {what}" for c, what in COMMANDS.items())
          + ", Ctrl-C stops a reply", file=sys.stderr)
    opening = [{"role": "system", "content": system}] if system else []
    history = list(opening)
    generator = model.generator(seed)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                "top_p": top_p, "generator": generator}
    while True:
        line = _read(terminal)
        if line is None or line.strip() == "/exit":
            return 0
        message = line.strip()
        if not message:
            continue
        if message == "/reset":
            history = list(opening)
            print("(the conversation starts again)", file=sys.stderr)
            continue
        history.append({"role": "user", "content": message})
        reply = _reply(model, template, history, sampling)
        history.append({"role": "assistant", "content": reply})


def _read(terminal: bool) -> str | None:
    """The next message; None at the end of input. Ctrl-C at the prompt only says how to
    leave."""
    while True:
        try:
            if terminal:
                return input(">>> ")
            line = sys.stdin.readline()
            return line if line else None
        except EOFError:
            print(file=sys.stderr)
            return None
        except KeyboardInterrupt:
            print("\n(/exit or Ctrl-D ends the session)", file=sys.stderr)


def _reply(model: Any, template: Any, history: list[dict[str, str]],
           sampling: dict[str, Any]) -> str:
    """The model's reply to the conversation so far, written out as it is decoded."""
    from tformer.data.chat import ChatTemplateError, encode_text
    from tformer.errors import TformerError

    try:
        prompt = template.render(history, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise TformerError(f"the chat template refused the conversation: {e}") from None
    ids = encode_text(model.tokenizer, prompt)
    window = model.window
    if window is not None and len(ids) > window:
        print(f"(the conversation is {len(ids)} tokens, the context {window}: the model reads "
              f"the last {window}; /reset starts again)", file=sys.stderr)
    pieces: list[str] = []
    try:
        for piece in model.stream(ids, **sampling):
            if not pieces:
                piece = piece.lstrip()
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        print("\n(stopped)", file=sys.stderr)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces).strip()
