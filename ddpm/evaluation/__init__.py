"""Sample quality: who judges which data, the digits judge and the sweep, FID/KID."""
