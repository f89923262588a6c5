"""What the server shows about itself: Prometheus metrics, the memory snapshot behind them, the live engine view and the built-in web page."""
