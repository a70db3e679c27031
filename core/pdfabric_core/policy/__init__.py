"""One module per upstream PD rule; see each module's docstring for its upstream source."""
