"""Rate limits, abuse and what a hostile visitor or a written Redis may try."""
