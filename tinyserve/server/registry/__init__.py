"""The models a server serves: the registry (which are loaded, on demand, within bounds), one slot per model and its life, and the admin API that loads, unloads and swaps them."""
