"""`dsv4`, the command line: the only package that knows the engine, the router and the
operator, and hands each what it needs as arguments."""
