"""What the engine publishes for the server to show: per-step statistics and the recent past (steps and finished samples) for the live view."""
