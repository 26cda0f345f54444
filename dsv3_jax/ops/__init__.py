"""Pure jnp functions the modules call: routing math, expert dispatch, attention."""
