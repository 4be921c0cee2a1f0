"""Planning without the hardware: `plan`, `explain`, reports of a plan, `max_batch` (`capacity`) and the
measured alpha-beta model (`calibrate`)."""
