"""Building blocks of the decoder layer, each a pure function of arrays and weights."""
