"""miaohui.engines"""
