"""`kvmesh generate PROMPT`: run the engine in this process and stream the answer."""

import sys

from kvmesh.commands import add_command


def register(subparsers) -> None:
    p = add_command(subparsers, "generate", run,
                    help="generate text from a prompt on this machine (no cluster)")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None,
                   help="model: smollm2-135m-instruct (default), a Hugging Face directory, a .gguf file, "
                        "or random:<preset>")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="apply the model's chat template (the default for models that have one)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as raw text")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")


def run(args) -> int:
    """Generate text from PROMPT with the local engine, streaming it."""
    from kvmesh import LLM, SamplingParams

    if not args.prompt.strip():
        raise ValueError("prompt must not be empty")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    llm = LLM(model=args.model, device=args.device) if args.model else LLM(device=args.device)
    chat = args.chat if args.chat is not None else getattr(llm.tokenizer, "chat_template", None) is not None
    if chat:
        ids = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        ids = llm.encode(args.prompt)
    finish = None
    for delta in llm.stream(ids, params, prompt=args.prompt):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        finish = delta.finish_reason
    sys.stdout.write("\n")
    if finish == "error":
        print("kvmesh generate: the request failed", file=sys.stderr)
        return 1
    return 0
