"""Building the engine's parts: the loaded model prepared, its KV cache planned, the
runner, scheduler and sampling side made. Sits above model/, cpu/, lora/, recurrent/
and sampling/, which it assembles; none of them imports it."""
