"""What communication costs, as formulas: the alpha-beta `model`, the bytes each collective moves
(`volumes`), the layout-to-layout walk and the per-rank bytes of inserted modules (`planned`), and the
blocks of uneven SUMMA products (`summa_blocks`). Nothing here runs a collective or edits a graph."""
