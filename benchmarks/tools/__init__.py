"""Tools beside the timed suite (the runner never calls them): ``profile_hot``, ``save_memory``."""
