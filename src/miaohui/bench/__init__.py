"""miaohui.bench"""
