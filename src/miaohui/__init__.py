"""miaohui (秒回): compile dialogue models into checked, optimized engines and serve them in milliseconds."""

__version__ = "0.1.0"
