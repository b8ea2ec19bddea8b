"""The whole stack: claw up, the demo, soaks, and the layering rules."""
