"""miaohui.serving"""
