from passes.ops import library as library  # registers the autopar:: ops the runtime modules call
from passes.ops import overlap as overlap  # registers the ops that overlap a weight gradient's reduction
