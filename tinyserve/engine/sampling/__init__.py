"""The next token of every sequence: logits processing, the draw, and structured output (llguidance grammars, their budgets, their cache, and the big-stack thread that compiles them)."""
