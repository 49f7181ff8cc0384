"""Tools beside the timed suite (the runner never calls them): ``profile_hot``."""
