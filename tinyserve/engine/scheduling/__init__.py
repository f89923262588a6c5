"""Which requests compute how many tokens in the next step, and the paged KV blocks they hold (block tables, reference counts, the prefix cache): pure Python over token ids."""
