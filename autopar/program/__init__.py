"""One input signature's program and what keeps its ranks honest: building it (`build`), the outputs it
returns (`outputs`), the checks ranks agree on (`guards`, `consensus`) and uneven splits (`uneven`)."""
