"""miaohui.validate"""
