from passes.ops import library as library  # registers the autopar:: ops the runtime modules call
