"""The pure core: signals, alerting, policy and diagnosis. No I/O, no clock, no logging."""
