"""nlq-scale: do nonlinear query projections in attention keep winning as models grow?"""

__version__ = "0.1.0"
