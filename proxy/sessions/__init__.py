"""Sessions at run time: the stores (memory, Redis), the service the gate asks, and the admin API."""
